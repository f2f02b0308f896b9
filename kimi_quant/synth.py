"""Write a K3.1-shaped BF16 checkpoint: exact tensor names of the real model, small dimensions.

``tiny`` uses the trained fixture shipped in ``model/fixtures/tiny`` when present (a model whose
perplexity means something, with its own tokenizer); otherwise, and for ``bench``, weights are
seeded random. Tensors are scattered over several shards so that, as in real checkpoints, the
experts of one layer live in different files.
"""

from __future__ import annotations

import math
import shutil
import zlib
from importlib import resources
from pathlib import Path

import numpy as np

from .dtypes import STORAGE, f32_to_bf16
from .quant import get_codec
from .source.compressed import CODES_SUFFIX, MX_BLOCK, SCALES_SUFFIX, mxfp4_quantization_config
from .source.safetensors import SafetensorsReader
from .write import ShardWriter, write_json_atomic
from .write.safetensors_writer import encode_header
from .errors import KimiQuantError
from .model.presets import preset_config
from .model.spec import spec_from_config

FIXTURE_FILES = ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py", "generation_config.json")


def fixture_dir(preset: str) -> Path | None:
    d = Path(str(resources.files("kimi_quant.model").joinpath("fixtures", preset)))
    return d if (d / "model.safetensors").exists() else None


def _copy_tokenizer(out: Path) -> None:
    """The tiny model's tokenizer (ids < 1024, within every preset's vocabulary): a synthetic
    checkpoint can then be validated (perplexity needs text turned into ids) like a real one."""
    tok = fixture_dir("tiny")
    if tok is None:
        return
    for name in FIXTURE_FILES:
        if (tok / name).exists():
            shutil.copy(tok / name, out / name)


def random_tensor(name: str, shape: tuple[int, ...], dtype: str, seed: int, kda_heads: int = 0) -> np.ndarray:
    """Seeded random values for tensor ``name``, by kind (norms 1, biases and residual projections 0, weights
    scaled by fan-in). A 1-D ``A_log`` longer than ``kda_heads`` is padded with zeros, as the K3 release
    stores it (the official code reads only the first h)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if "norm" in name or name.endswith("k_norm.bias"):
        x = np.ones(shape, np.float32) if not name.endswith("bias") else np.zeros(shape, np.float32)
    elif name.endswith("A_log"):
        x = np.log(rng.uniform(1, 16, size=shape)).astype(np.float32)
        if len(shape) == 1 and kda_heads:
            x[kda_heads:] = 0
    elif name.endswith(("dt_bias", "e_score_correction_bias")) or "res_proj" in name:
        x = np.zeros(shape, np.float32)
    else:
        fan_in = shape[-1] if len(shape) > 1 else 1
        x = rng.standard_normal(size=shape, dtype=np.float32) * np.float32(1.0 / math.sqrt(max(fan_in, 1)))
    return f32_to_bf16(x) if dtype == "BF16" else x.astype(STORAGE[dtype])


def _assign_shards(tensors: dict[str, tuple[tuple[int, ...], str]], shard_size: int, scatter: int) -> list[list[str]]:
    names = list(tensors)
    if scatter:
        shards: list[list[str]] = [[] for _ in range(scatter)]
        for n in names:
            shards[zlib.crc32(n.encode()) % scatter].append(n)
        return [s for s in shards if s]
    out: list[list[str]] = [[]]
    size = 0
    for n in names:
        shape, dt = tensors[n]
        b = math.prod(shape) * STORAGE[dt].itemsize
        if out[-1] and size + b > shard_size:
            out.append([])
            size = 0
        out[-1].append(n)
        size += b
    return out


def _write_sparse(out: Path, tensors, shards: list[list[str]]) -> dict[str, str]:
    """Shards with real headers and sparse (all-zero, no disk) data: plan-only stand-ins for huge models."""
    weight_map = {}
    n = len(shards)
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        header = encode_header([(nm, tensors[nm][1], tensors[nm][0]) for nm in names])
        size = len(header) + sum(math.prod(tensors[nm][0]) * STORAGE[tensors[nm][1]].itemsize for nm in names)
        with open(out / file, "wb") as f:
            f.write(header)
            f.truncate(size)
        weight_map.update((nm, file) for nm in names)
    return weight_map


def _is_checkpoint_file(name: str) -> bool:
    """Files an earlier synth (or any HF checkpoint) wrote, which would mix with or mislabel a new one."""
    return (name.startswith("model") and name.endswith(".safetensors")) or name in (
        "model.safetensors.index.json", "config.json", "README.md", *FIXTURE_FILES)


def _prepare_output(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty directory (its config would be replaced and its other shards left behind);
    with ``overwrite``, delete the previous checkpoint's files first."""
    if out.exists() and not out.is_dir():
        raise KimiQuantError(f"{out}: exists and is not a directory")
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if present and not overwrite:
        raise KimiQuantError(f"{out} is not empty (it holds {present[0]!r}{' and more' if len(present) > 1 else ''}); "
                             "choose another --output, or pass --overwrite to replace the checkpoint there")
    for name in present:
        if _is_checkpoint_file(name) and (out / name).is_file():
            (out / name).unlink()
    out.mkdir(parents=True, exist_ok=True)


#: the routed experts as Moonshot publishes Kimi K3 (compressed-tensors' regex target for its experts)
RELEASED_EXPERT_TARGETS = [r"re:.*block_sparse_moe\.experts\.\d+\.(w1|w2|w3)$"]
EXPERT_FORMATS = ("bf16", "mxfp4")


def _inventory(config: dict, experts: str) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict[str, str]]:
    """(stored tensors: name -> (shape, dtype), packed codes name -> its logical weight). With
    ``experts="mxfp4"`` each routed expert weight [N, K] is stored as compressed-tensors stores it:
    ``weight_packed`` U8 [N, K/2] then ``weight_scale`` U8 [N, K/32]."""
    spec = spec_from_config(config)
    tensors = spec.expected_tensors()
    if experts == "bf16":
        return tensors, {}
    stored: dict[str, tuple[tuple[int, ...], str]] = {}
    packed: dict[str, str] = {}
    for name, (shape, dtype) in tensors.items():
        if spec.role(name).role.startswith("routed_expert."):
            base = name[: -len(".weight")]
            stored[base + CODES_SUFFIX] = ((shape[0], shape[1] // 2), "U8")
            stored[base + SCALES_SUFFIX] = ((shape[0], shape[1] // MX_BLOCK), "U8")
            packed[base + CODES_SUFFIX] = name
        else:
            stored[name] = (shape, dtype)
    return stored, packed


def _with_experts(config: dict, experts: str) -> dict:
    """config.json as published: with the compressed-tensors quantization_config for MXFP4 experts."""
    if experts == "bf16":
        return config
    return {**config, "quantization_config": mxfp4_quantization_config(RELEASED_EXPERT_TARGETS)}


def write_header_only(config: dict, out: Path, shard_size: int = 512 * 1024**2, experts: str = "bf16") -> Path:
    """The tensor inventory of ``config`` (any supported family) as header-only shards, tensor bytes
    left as holes, then index and config: what ``plan`` needs to size a real model without its data."""
    tensors, _ = _inventory(config, experts)
    out.mkdir(parents=True, exist_ok=True)
    weight_map = _write_sparse(out, tensors, _assign_shards(tensors, shard_size, scatter=0))
    total = sum(math.prod(s) * STORAGE[d].itemsize for s, d in tensors.values())
    write_json_atomic(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json_atomic(out / "config.json", _with_experts(config, experts))
    return out


def synth(preset: str, output: str | Path, seed: int = 0, num_experts: int | None = None,
          shard_size: int = 512 * 1024**2, random_weights: bool = False, progress: bool = False,
          sparse: bool = False, overwrite: bool = False, experts: str = "bf16") -> Path:
    """Write preset ``tiny``, ``bench`` or (``sparse`` only) ``full`` to ``output``; returns the directory.

    ``sparse``: headers only, tensor bytes left as holes (zeros) -- for ``plan`` on the real 2.8T inventory.
    ``experts="mxfp4"``: the routed experts as Kimi K3 is published, compressed-tensors
    ``mxfp4-pack-quantized`` (each expert's weights put on the MXFP4 grid by the W4A8_MXFP rule, stored as
    codes and scales); the rest BF16.
    ``output`` must be empty or absent; ``overwrite`` first deletes an earlier checkpoint's files there.
    Config and index are written last, so an interrupted run never looks like a complete checkpoint.
    """
    if experts not in EXPERT_FORMATS:
        raise KimiQuantError(f"experts {experts!r}: one of {', '.join(EXPERT_FORMATS)}")
    if num_experts is not None and num_experts < 1:
        raise KimiQuantError(f"--num-experts {num_experts}: a MoE layer needs at least 1 expert")
    config = preset_config(preset, num_experts=num_experts)  # refuses bad arguments before any file is touched
    out = Path(output)
    _prepare_output(out, overwrite)
    if sparse or preset == "full":
        _copy_tokenizer(out)
        return write_header_only(config, out, shard_size, experts)
    tensors, packed = _inventory(config, experts)
    spec = spec_from_config(config)
    logical = spec.expected_tensors()
    heads = spec.text.kda_num_heads
    fixture = None if (random_weights or num_experts) else fixture_dir(preset)
    reader = SafetensorsReader(fixture / "model.safetensors") if fixture else None
    shards = _assign_shards(tensors, shard_size, scatter=4 if preset == "tiny" else 0)
    n = len(shards)
    weight_map: dict[str, str] = {}
    packed_parts = {part: logical for codes, logical in packed.items()
                    for part in (codes, codes[: -len(CODES_SUFFIX)] + SCALES_SUFFIX)}
    pending: dict[str, dict[str, np.ndarray]] = {}  # the part of a pair not written yet (shards may split pairs)

    def mx_part(part: str) -> np.ndarray:
        name = packed_parts[part]
        if name not in pending:
            w = reader.array(name) if reader is not None else random_tensor(name, *logical[name], seed, heads)
            mx = get_codec("W4A8_MXFP").quantize_bf16(np.ascontiguousarray(w))
            base = name[: -len(".weight")]
            pending[name] = {base + CODES_SUFFIX: mx["weight"], base + SCALES_SUFFIX: mx["weight_scale"]}
        arr = pending[name].pop(part)
        if not pending[name]:
            del pending[name]
        return arr

    total = 0
    bar = None
    if progress:
        from .progress import progress_bar

        bar = progress_bar(sum(math.prod(s) * STORAGE[d].itemsize for s, d in tensors.values()), f"synth {preset}")
    try:
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            writer = ShardWriter(out / file, [(nm, tensors[nm][1], tensors[nm][0]) for nm in names])
            for nm in names:
                shape, dt = tensors[nm]
                if nm in packed_parts:  # a routed expert put on the MXFP4 grid, stored as codes and scales
                    arr = mx_part(nm)
                else:
                    arr = reader.array(nm) if reader is not None else random_tensor(nm, shape, dt, seed, heads)
                writer.write(nm, arr)
                weight_map[nm] = file
                total += arr.nbytes
                if bar:
                    bar.update(arr.nbytes)
            writer.commit()
    finally:
        if reader is not None:
            reader.close()
        if bar:
            bar.close()
    _copy_tokenizer(out)  # before config.json: written last, it marks the checkpoint complete
    write_json_atomic(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json_atomic(out / "config.json", _with_experts(config, experts))
    released = (" Routed experts are MXFP4 (compressed-tensors mxfp4-pack-quantized), as Kimi K3 is published."
                if experts == "mxfp4" else "")
    (out / "README.md").write_text(
        f"# Synthetic Kimi K3.1-shaped checkpoint ({preset})\n\nWritten by `kimi-quant synth --preset {preset}`"
        f" (seed {seed}). Tensor names and structure follow Kimi K3.1; dimensions are small.{released}\n")
    return out
