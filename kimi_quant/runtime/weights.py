"""Weight loaders for the layer-streamed reference forward.

``WeightLoader.layer(i)`` returns one decoder layer's weights as fp32 tensors keyed by names relative
to the layer prefix, plus the activation quantizer each Linear's input gets (empty for BF16 sources).
Only the shards holding that layer are touched; nothing else stays resident.

* :class:`SourceLoader` reads a BF16 source checkpoint (``model.safetensors.index.json`` or a single
  ``model.safetensors``).
* :class:`QuantizedLoader` reads an ascendV1 output directory (``quant_model_description.json`` +
  ``quant_model_weights.safetensors.index.json``), dequantizes each quantized Linear with its codec
  (``kimi_quant.quant.get_codec(TYPE).dequantize``) and takes FLOAT tensors as they are. Linears of
  type W8A8_DYNAMIC / W4A8_DYNAMIC get int8 per-token activations, W8A8_MXFP8 / W4A8_MXFP get MXFP8.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from ..dtypes import to_f32
from ..errors import BadCheckpoint, KimiQuantError
from ..model.spec import ModelSpec, load_model_spec
from ..quant import REGISTRY, decode_mxfp4
from ..source.compressed import CODES_SUFFIX, MX_BLOCK, SCALES_SUFFIX, check_mxfp4_scales, packing_declared
from ..source.local import LocalSource
from ..source.safetensors import SafetensorsReader
from ..untrusted import parse_json
from .supported import check_supported

QUANT_DESCRIPTION = "quant_model_description.json"
QUANT_INDEX = "quant_model_weights.safetensors.index.json"
SOURCE_INDEX = "model.safetensors.index.json"
SOURCE_SINGLE = "model.safetensors"

QUANT_SUFFIXES = ("weight_scale", "weight_offset", "scale_bias", "weight_scale_second", "weight_offset_second")
EMBED_NAMES = ("model.embed_tokens.weight",)
HEAD_NAMES = ("model.norm.weight", "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight",
              "lm_head.weight")
GLOBAL_NAMES = EMBED_NAMES + HEAD_NAMES
#: routed-expert tensors (relative to the layer prefix): loaded lazily, one expert at a time
ROUTED_EXPERT = re.compile(r"block_sparse_moe\.experts\.\d+\.")


class LazyLayer(Mapping):
    """One layer's weights, relative names -> fp32 tensors. Everything but the routed experts is
    loaded up front; a routed expert's tensor is read (and dequantized) from the checkpoint each time
    it is looked up and not kept, so the caller holds at most the experts it is computing with
    (:func:`kimi_quant.runtime.forward.moe_many` looks each used expert up once per layer)."""

    def __init__(self, loader: "WeightLoader", prefix: str, dense: dict[str, torch.Tensor], lazy: list[str]):
        self._loader = loader
        self._prefix = prefix
        self._dense = dense
        self._lazy = set(lazy)
        self._order = list(dense) + [n for n in lazy if n not in dense]
        self.loads = 0  # expert tensors read so far (for tests and benchmarks)

    def __getitem__(self, rel: str) -> torch.Tensor:
        t = self._dense.get(rel)
        if t is not None:
            return t
        if rel not in self._lazy:
            raise KeyError(rel)
        self.loads += 1
        return self._loader.tensor(self._prefix + rel, release=True)[0]

    def __contains__(self, rel: object) -> bool:
        return rel in self._dense or rel in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class WeightLoader:
    """Base: a spec, a weight map (tensor -> file) and cached shard readers."""

    root: Path
    spec: ModelSpec
    weight_map: dict[str, str]

    def __init__(self, root: str | Path, files=None, spec: ModelSpec | None = None):
        """``root``: a local checkpoint directory, whose spec is read and checked here; or, with ``files``
        (a Source: where the shards come from) and its ``spec``, the loader of any source."""
        self.root = Path(root)
        if files is None:
            if not self.root.is_dir():
                raise KimiQuantError(f"{self.root}: not a directory")
            files = LocalSource(self.root)
        self._files = files
        if spec is None:
            spec = load_model_spec(self.root)
            check_supported(spec.text)  # before any tensor is read: a setting the forward would ignore
        self.spec = spec
        self._readers: dict[str, SafetensorsReader] = {}
        self._expected = self.spec.expected_tensors(with_vision=False)

    @property
    def cfg(self):
        return self.spec.text

    def reader(self, file: str) -> SafetensorsReader:
        """The open reader of shard ``file`` (opened on first use, checked to lie in the checkpoint)."""
        r = self._readers.get(file)
        if r is None:
            # the index is input we did not write: its names go through the source's checks (no '..', no
            # link out of the directory), and the file opened is the one checked
            r = self._readers[file] = SafetensorsReader(*self._files.fetch_vetted(file))
        return r

    def _file_of(self, name: str) -> str:
        try:
            return self.weight_map[name]
        except KeyError:
            raise BadCheckpoint(f"{self.root}: tensor {name!r} is not in the weight map") from None

    def _raw(self, name: str) -> tuple[np.ndarray, str]:
        r = self.reader(self._file_of(name))
        return r.array(name), r.info(name).dtype

    def _release(self, name: str) -> None:
        """Drop the mapped pages of ``name`` (after it has been copied out)."""
        for stored in self._packed_parts(name) or (name,):
            r = self._readers.get(self.weight_map.get(stored, ""))
            if r is not None:
                r.release(stored)

    def _packed_parts(self, name: str) -> tuple[str, str] | None:
        """(codes, scales) when ``name`` is stored as a packed MXFP4 pair (a compressed-tensors source)."""
        if name in self.weight_map or not name.endswith(".weight"):
            return None
        codes, scales = name[: -len(".weight")] + CODES_SUFFIX, name[: -len(".weight")] + SCALES_SUFFIX
        return (codes, scales) if codes in self.weight_map and scales in self.weight_map else None

    def _float(self, name: str) -> torch.Tensor:
        parts = self._packed_parts(name)
        if parts:
            (codes, c_dt), (scales, s_dt) = (self._raw(p) for p in parts)
            if (c_dt, s_dt) != ("U8", "U8") or codes.ndim != 2 or scales.shape != (codes.shape[0], 2 * codes.shape[1] // MX_BLOCK):
                raise BadCheckpoint(f"{self.root}: {name!r} is packed as {c_dt}{list(codes.shape)} and "
                                    f"{s_dt}{list(scales.shape)}, not MXFP4 codes U8 [N, K/2] and scales U8 [N, K/32]")
            check_mxfp4_scales(scales, f"{self.root}: {name!r}")
            return torch.from_numpy(decode_mxfp4(codes, scales))
        arr, dtype = self._raw(name)
        return torch.from_numpy(np.array(to_f32(arr, dtype), dtype=np.float32, copy=True))

    def act_of(self, name: str) -> str | None:
        """The activation quantizer the device applies before Linear ``name`` (None for BF16 sources)."""
        return None

    def tensor(self, name: str, release: bool = False) -> tuple[torch.Tensor, str | None]:
        """(fp32 tensor, activation quantizer or None) for full tensor name ``name``; ``release``
        drops its mapped pages afterwards."""
        t = self._float(name)
        if release:
            self._release(name)
        return t, None

    def _load(self, names: list[str], strip: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        w: dict[str, torch.Tensor] = {}
        act: dict[str, str] = {}
        for n in names:
            t, a = self.tensor(n)
            rel = n[len(strip):]
            w[rel] = t
            if a:
                act[rel] = a
        return w, act

    def globals(self, names: tuple[str, ...] = GLOBAL_NAMES) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Non-layer tensors (relative to the text prefix); ``names`` picks a subset (EMBED_NAMES /
        HEAD_NAMES, so the embedding and the LM head need not be resident at the same time)."""
        p = self.spec.prefix
        out = self._load([p + n for n in names if p + n in self._expected], p)  # no attn-res tensors without attn_res_block_size
        self.release()
        return out

    def layer(self, i: int, lazy_experts: bool = True) \
            -> tuple[Mapping[str, torch.Tensor], dict[str, str]]:
        """Layer ``i``: (weights by relative name, activation quantizer by relative name).

        ``lazy_experts`` (default): a :class:`LazyLayer` whose routed experts are read on lookup, so
        memory is the dense part of the layer plus the experts in use. ``False``: a dict with every
        tensor loaded in fp32 (the whole layer resident; the reference the lazy path must match)."""
        lp = f"{self.spec.prefix}model.layers.{i}."
        names = [n for n in self._expected if n.startswith(lp)]
        if not lazy_experts:
            out = self._load(names, lp)
            self.release()
            return out
        lazy = [n for n in names if ROUTED_EXPERT.match(n, len(lp))]
        lazy_set = set(lazy)
        w, act = self._load([n for n in names if n not in lazy_set], lp)
        self.release()
        for n in lazy:
            a = self.act_of(n)
            if a:
                act[n[len(lp):]] = a
        return LazyLayer(self, lp, w, [n[len(lp):] for n in lazy]), act

    def release(self) -> None:
        for r in self._readers.values():
            for name in r.tensors:
                r.release(name)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_json(path: Path) -> dict:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise KimiQuantError(f"{path}: not found") from None
    out = parse_json(data, str(path), unique_keys=True)
    if not isinstance(out, dict):
        raise BadCheckpoint(f"{path}: expected a JSON object, got a {type(out).__name__}")
    return out


class SourceLoader(WeightLoader):
    """A source checkpoint directory: BF16 (or F32), or compressed-tensors with packed MXFP4 experts
    (decoded exactly on read)."""

    def __init__(self, root: str | Path):
        super().__init__(root)
        index = self.root / SOURCE_INDEX
        if index.exists():
            wm = _read_json(index).get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise BadCheckpoint(f"{index}: has no weight_map")
            self.weight_map = {str(k): str(v) for k, v in wm.items()}
        elif (self.root / SOURCE_SINGLE).exists():
            self.weight_map = {n: SOURCE_SINGLE for n in self.reader(SOURCE_SINGLE).tensors}
        else:
            raise KimiQuantError(f"{self.root}: no {SOURCE_INDEX} and no {SOURCE_SINGLE}: not a source checkpoint")
        # packed pairs are decoded only in the one format read here; any other quantization is refused
        packing_declared(f"{self.root}/config.json", self.spec.config,
                         sorted(n for n in self.weight_map if n.endswith(CODES_SUFFIX)))


class QuantizedLoader(WeightLoader):
    """An ascendV1 output directory, dequantized on read."""

    def __init__(self, root: str | Path):
        super().__init__(root)
        if not (self.root / QUANT_DESCRIPTION).exists():
            raise KimiQuantError(f"{self.root}: no {QUANT_DESCRIPTION}: not an ascendV1 quantized directory")
        self.description = _read_json(self.root / QUANT_DESCRIPTION)
        g = self.description.get("group_size", 0)
        if not isinstance(g, int) or isinstance(g, bool) or g < 0:
            raise BadCheckpoint(f"{self.root / QUANT_DESCRIPTION}: group_size {g!r} is not a non-negative integer")
        self.group_size = g  # read as the loader reads it: W4A8_DYNAMIC per group when > 0
        wm = _read_json(self.root / QUANT_INDEX).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise BadCheckpoint(f"{self.root / QUANT_INDEX}: has no weight_map")
        self.weight_map = {str(k): str(v) for k, v in wm.items()}

    def type_of(self, name: str) -> str:
        t = self.description.get(name)
        if not isinstance(t, str):
            raise BadCheckpoint(f"{self.root / QUANT_DESCRIPTION}: no type for tensor {name!r}")
        return t

    def act_of(self, name: str) -> str | None:
        qtype = self.type_of(name)
        if qtype == "FLOAT":
            return None
        if qtype not in REGISTRY:
            raise KimiQuantError(f"{self.root}: tensor {name!r} has type {qtype!r}, which validation cannot "
                                 f"simulate (supported: FLOAT, {', '.join(sorted(REGISTRY))})")
        return REGISTRY[qtype].activation

    def tensor(self, name: str, release: bool = False) -> tuple[torch.Tensor, str | None]:
        qtype = self.type_of(name)
        if qtype == "FLOAT":
            t = self._float(name)
            if release:
                self._release(name)
            return t, None
        act = self.act_of(name)
        from ..quant import get_codec

        base = name[: -len("weight")] if name.endswith("weight") else name + "."
        parts = {"weight": np.array(self._raw(name)[0], copy=True)}
        for suf in QUANT_SUFFIXES:
            if base + suf in self.weight_map:
                parts[suf] = np.array(self._raw(base + suf)[0], copy=True)
        if release:
            self._release(name)
            for suf in QUANT_SUFFIXES:
                self._release(base + suf)
        try:
            w = np.asarray(get_codec(qtype, self.group_size).dequantize(parts), dtype=np.float32)
        except (KeyError, ValueError) as e:
            raise BadCheckpoint(f"{self.root}: {name!r} ({qtype}, group_size {self.group_size}): {e}") from None
        del parts
        shape = self._expected.get(name, (None,))[0]
        if shape is not None and tuple(w.shape) != tuple(shape):
            raise BadCheckpoint(f"{self.root}: {name!r} dequantizes to {list(w.shape)}, expected {list(shape)}")
        return torch.from_numpy(np.ascontiguousarray(w)), act
