"""``kimi-quant verify``: is an output directory complete, intact and self-consistent?

Re-hashes every shard against the journal, reads every header, and checks that index,
description and tensor shapes agree with what each ascendV1 type requires. Runs before publish.
A validation recorded as failed (``--max-ppl-increase``) is reported after the structure checks
(``verify`` exits 3, ``publish`` refuses it unless ``--force``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import KimiQuantError
from .hashing import sha256_file, sha256_files
from .journal import Journal, finish_hint, unfinished
from .layout.ascend_v1 import CALIB_STATE, DESCRIPTION, INDEX, PROVENANCE
from .dtypes import nonfinite
from .plan import MXFP4_LOADER_K_MULTIPLE, model_quant_type_meaning, moe_layer_types
from .quant.numerics import INT4_GROUP_SIZES
from .source.safetensors import SafetensorsReader, read_header
from .untrusted import inside, unsafe_name

TOP_LEVEL = ("version", "model_quant_type", "group_size", "metadata", "optional")


def _fail(out_dir: Path, msg: str) -> KimiQuantError:
    return KimiQuantError(f"{out_dir}: verify failed: {msg}")


def _load_json(out_dir: Path, name: str) -> dict:
    try:
        data = json.loads((out_dir / name).read_text())
    except FileNotFoundError:
        raise _fail(out_dir, f"{name} is missing (conversion incomplete?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(out_dir, f"{name} is not valid JSON ({e})") from None
    except RecursionError:
        raise _fail(out_dir, f"{name} is nested too deeply to be kimi-quant's") from None
    if not isinstance(data, dict):
        raise _fail(out_dir, f"{name} is not a JSON object")
    return data


def _check_types(out_dir: Path, desc: dict, shapes: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Each quantized Linear's tensors have the dtypes and shapes its type requires."""
    for name, typ in desc.items():
        for suffix in (".weight_scale", ".weight_offset", ".scale_bias", ".weight_scale_second",
                       ".weight_offset_second"):
            if name.endswith(suffix) and name not in TOP_LEVEL:
                w = name[: -len(suffix)] + ".weight"
                if desc.get(w) != typ and (typ != "FLOAT" or w in desc):
                    raise _fail(out_dir, f"{DESCRIPTION}: {name} is {typ} but {w} is {desc.get(w)}")
        if name in TOP_LEVEL or typ == "FLOAT" or not name.endswith(".weight"):
            continue
        base = name[: -len(".weight")]
        dt, shp = shapes[name]
        scale = shapes.get(base + ".weight_scale")
        if scale is None:
            raise _fail(out_dir, f"{base}: {typ} weight without weight_scale")
        if typ == "W4A8_DYNAMIC":
            N, K = 2 * shp[0], shp[1]
            want = {"weight": ("I8", (N // 2, K)), "weight_scale": ("F32", (N, 1)), "weight_offset": ("F32", (N, 1))}
            sb = shapes.get(base + ".scale_bias")
            if sb is None or sb[0] != "F32" or sb[1][0] != N or sb[1][1] not in (1, 16):
                raise _fail(out_dir, f"{base}.scale_bias: missing or not F32 [N,1]/[N,16] (N={N})")
            G = desc["group_size"]
            if G:  # the loader's per-group path: K / G scales per output channel
                if K % G:
                    raise _fail(out_dir, f"{base}: W4A8_DYNAMIC with K={K} under group_size {G}: K is not a multiple")
                want["weight_scale_second"] = want["weight_offset_second"] = ("F32", (N, K // G))
            else:
                for suffix in ("weight_scale_second", "weight_offset_second"):
                    if base + "." + suffix in shapes:
                        raise _fail(out_dir, f"{base}.{suffix}: per-group scales but group_size is 0 (the loader "
                                             "would read per-channel scales only)")
        elif typ == "W8A8_DYNAMIC":
            N, K = shp
            want = {"weight": ("I8", (N, K)), "weight_scale": ("F32", (N, 1)), "weight_offset": ("F32", (N, 1))}
        elif typ == "W4A8_MXFP":
            N, K = shp[0], 2 * shp[1]
            want = {"weight": ("U8", (N, K // 2)), "weight_scale": ("U8", (N, K // 32))}
            if K % MXFP4_LOADER_K_MULTIPLE:
                raise _fail(out_dir, f"{base}: W4A8_MXFP with K={K}: vLLM-Ascend needs K divisible by "
                                     f"{MXFP4_LOADER_K_MULTIPLE} (it pairs the 32-blocks' scales)")
        elif typ == "W8A8_MXFP8":
            N, K = shp
            want = {"weight": ("F8_E4M3", (N, K)), "weight_scale": ("U8", (N, K // 32))}
        else:
            raise _fail(out_dir, f"{name}: unknown type {typ!r} in {DESCRIPTION}")
        for suffix, (wdt, wshape) in want.items():
            got = shapes.get(f"{base}.{suffix}")
            if got is None or got[0] != wdt or tuple(got[1]) != wshape:
                raise _fail(out_dir, f"{base}.{suffix}: is {got}, {typ} needs {wdt}{list(wshape)}")


def _check_finite(out_dir: Path, files: list[str], desc: dict) -> None:
    """No float tensor written holds a NaN or an Inf (of its dtype; MX scales as E8M0, whose NaN is 0xFF)."""
    from .quant import REGISTRY

    for f in files:
        with SafetensorsReader(out_dir / f) as r:
            for name, t in r.tensors.items():
                base, _, suffix = name.rpartition(".")
                codec = REGISTRY.get(desc.get(base + ".weight"))
                dtype = "F8_E8M0" if codec is not None and suffix in codec.e8m0_outputs else t.dtype
                if dtype not in ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0"):
                    continue
                arr = r.array(name).reshape(-1)
                step = 1 << 24
                for i in range(0, arr.size, step):
                    if nonfinite(arr[i:i + step], dtype):
                        raise _fail(out_dir, f"{f}: tensor {name!r} holds a NaN or Inf")
                r.release(name)


def _check_top_level(out_dir: Path, desc: dict) -> None:
    """model_quant_type is the highest type present (W4A8_DYNAMIC never counting); group_size fits it."""
    from .quant import REGISTRY

    present = {v for k, v in desc.items() if k not in TOP_LEVEL}
    unknown = sorted(t for t in present if t != "FLOAT" and t not in REGISTRY)
    if unknown:
        raise _fail(out_dir, f"{DESCRIPTION}: unknown type {unknown[0]!r}")
    ranked = [(REGISTRY[t].rank, t) for t in present if t != "FLOAT" and REGISTRY[t].rank is not None]
    want = max(ranked)[1] if ranked else "FLOAT"
    if desc["model_quant_type"] != want:
        raise _fail(out_dir, f"{DESCRIPTION}: model_quant_type is {desc['model_quant_type']!r} but the highest "
                             f"type present is {want!r}")
    if desc["version"] != "1.0.0":
        raise _fail(out_dir, f"{DESCRIPTION}: version {desc['version']!r} is not '1.0.0'")
    mx = any(t.endswith(("MXFP", "MXFP8")) for t in present)
    G = desc["group_size"]
    if not isinstance(G, int) or isinstance(G, bool) or G < 0:
        raise _fail(out_dir, f"{DESCRIPTION}: group_size {G!r} is not a non-negative integer")
    if mx and G != 32:
        raise _fail(out_dir, f"{DESCRIPTION}: group_size {G!r} but MX types need 32")
    if not mx and ranked + [t for t in present if t == "W4A8_DYNAMIC"] and G not in (0, *INT4_GROUP_SIZES):
        raise _fail(out_dir, f"{DESCRIPTION}: group_size {G!r} but the int path needs 0 (per channel) or one of "
                             f"{', '.join(map(str, INT4_GROUP_SIZES))} (per-group W4A8_DYNAMIC)")


def _check_provenance(out_dir: Path, journal: Journal) -> dict:
    """The provenance names the same conversion and the same shards (size, sha256) as the journal."""
    prov = _load_json(out_dir, PROVENANCE)
    if prov.get("plan_fingerprint") != journal.start.get("fingerprint"):
        raise _fail(out_dir, f"{PROVENANCE} belongs to another conversion (plan fingerprint differs)")
    outputs = prov.get("outputs") or {}
    for f, rec in journal.units.items():
        got = (outputs.get(f) if isinstance(outputs, dict) else None) or {}
        got = got if isinstance(got, dict) else {}
        if got.get("sha256") != rec["sha256"] or got.get("size") != rec["size"]:
            raise _fail(out_dir, f"{PROVENANCE}: record of {f} differs from the journal")
    return prov


def verify_output(out_dir: str | Path, rehash: bool = True, quiet: bool = True) -> dict:
    """Raise KimiQuantError (one line) unless ``out_dir`` is a complete, intact ascendV1 output.
    ``rehash``: check every shard's sha256 against the journal (in parallel; a progress bar unless ``quiet``)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise KimiQuantError(f"{out_dir}: not a directory")
    journal = Journal(out_dir)
    if journal.start is None:
        raise _fail(out_dir, "no kimi-quant journal (not written by kimi-quant?)")
    if not journal.complete:
        raise _fail(out_dir, f"conversion incomplete ({unfinished(journal, out_dir)})")
    if os.path.lexists(out_dir / CALIB_STATE):
        raise _fail(out_dir, f"{CALIB_STATE} is left over: the calibrated run stopped before removing its state "
                             f"(activations of the calibration text, not part of the output); "
                             f"{finish_hint(journal, out_dir)}")
    for name, sha in journal.metadata.items():
        if not (out_dir / name).exists():
            raise _fail(out_dir, f"{name} is missing")
        if rehash and sha256_file(out_dir / name) != sha:
            raise _fail(out_dir, f"{name}: sha256 differs from the one recorded at completion (edited?)")
    index = _load_json(out_dir, INDEX)
    desc = _load_json(out_dir, DESCRIPTION)
    weight_map = index.get("weight_map") or {}
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _fail(out_dir, f"{INDEX}: weight_map is not an object of file names")
    files = sorted(set(weight_map.values()))
    if set(files) != set(journal.units):
        raise _fail(out_dir, f"index names {len(files)} shards, journal {len(journal.units)}")
    for f in [*files, *journal.metadata]:
        if unsafe_name(f) or (out_dir / f).is_symlink() or not inside(out_dir / f, out_dir):
            raise _fail(out_dir, f"{f} is a link (or a name) leading out of the output; an output holds only its "
                                 "own files")
    for f in files:
        p = out_dir / f
        if not p.exists():
            raise _fail(out_dir, f"{f} is missing")
        if p.stat().st_size != journal.units[f]["size"]:
            raise _fail(out_dir, f"{f} has {p.stat().st_size} bytes, journal says {journal.units[f]['size']}")
    if rehash:
        shas = sha256_files([out_dir / f for f in files], desc="verify", quiet=quiet)
        for f, sha in zip(files, shas):
            if sha != journal.units[f]["sha256"]:
                raise _fail(out_dir, f"{f}: sha256 differs from the journal (file damaged or modified)")
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    total = 0
    for f in files:
        p = out_dir / f
        tensors, _ = read_header(p)
        for name, t in tensors.items():
            if weight_map.get(name) != f:
                raise _fail(out_dir, f"{f}: tensor {name!r} is not mapped to this file in {INDEX}")
            shapes[name] = (t.dtype, t.shape)
            total += t.nbytes
    missing = set(weight_map) - set(shapes)
    if missing:
        raise _fail(out_dir, f"{INDEX} names tensor {sorted(missing)[0]!r} that no shard holds")
    if index.get("metadata", {}).get("total_size") != total:
        raise _fail(out_dir, f"{INDEX} total_size {index.get('metadata', {}).get('total_size')} != {total}")
    for key in TOP_LEVEL:
        if key not in desc:
            raise _fail(out_dir, f"{DESCRIPTION} lacks top-level key {key!r}")
    tensor_types = {k: v for k, v in desc.items() if k not in TOP_LEVEL and k in shapes}
    moe_keys = moe_layer_types(tensor_types)
    entries = {k for k in desc if k not in TOP_LEVEL and k not in moe_keys}
    if entries != set(shapes):
        extra = sorted(entries - set(shapes)) or sorted(set(shapes) - entries)
        raise _fail(out_dir, f"{DESCRIPTION} and the shards disagree on tensor {extra[0]!r}")
    for key, typ in moe_keys.items():  # what vLLM-Ascend reads for a model type it has no table for
        if desc.get(key) != typ:
            raise _fail(out_dir, f"{DESCRIPTION}: {key!r} is {desc.get(key)!r}, the layer's experts are {typ}")
    _check_top_level(out_dir, desc)  # first: _check_types relies on a sane group_size
    _check_types(out_dir, {k: v for k, v in desc.items() if k in TOP_LEVEL or k in shapes}, shapes)
    if rehash:
        _check_finite(out_dir, files, desc)
    prov = _check_provenance(out_dir, journal)
    config = _load_json(out_dir, "config.json")
    if "quantization_config" in config or "quantization_config" in (config.get("text_config") or {}):
        raise _fail(out_dir, "config.json still has quantization_config")
    from .layout.validation import validation_void

    void = validation_void(out_dir, journal, prov)  # a verdict about other files, or not covered: not this output's
    return {"shards": len(files), "tensors": len(shapes), "bytes": total,
            "model_quant_type": desc["model_quant_type"],
            "model_quant_type_meaning": model_quant_type_meaning(desc["model_quant_type"], set(tensor_types.values())),
            "validation": None if void else prov.get("validation"), "validation_void": void}

