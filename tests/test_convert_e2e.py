"""End to end: synth -> convert (both targets) -> read back with an independent decoder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import fresh_copy, snapshot
from independent_decoder import E2M1, bf16, decode_linear, expected_scale_bias, read_checkpoint
from kimi_quant.convert import ConvertOptions, convert
from kimi_quant.synth import synth

TOP = ("version", "model_quant_type", "group_size", "metadata", "optional")
SUFFIXES = ("weight", "weight_scale", "weight_offset", "scale_bias")


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-bf16")
    synth("tiny", d, random_weights=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fake"}  # must be stripped from the output
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "tokenizer_config.json").write_text("{}")
    return d


@pytest.fixture(scope="module")
def outputs(tiny_src, tmp_path_factory) -> dict[str, Path]:
    outs = {}
    for target in ("a3", "950dt"):
        out = tmp_path_factory.mktemp(f"out-{target}")
        convert(str(tiny_src), ConvertOptions(target=target, output=out, workers=1, quiet=True,
                                              max_shard_size=1_000_000))
        outs[target] = out
    return outs


def _int4_step(w: np.ndarray) -> np.ndarray:
    """The int4 step that clips nothing: max(max(w)/7, -min(w)/8) per row (the data-free rule)."""
    return np.maximum(np.maximum(w.max(1), 0) / 7, np.maximum(-w.min(1), 0) / 8)


def _naive_mx_sse(w: np.ndarray, elem: str) -> np.ndarray:
    N, K = w.shape
    b = w.reshape(N, K // 32, 32).astype(np.float64)
    amax = np.abs(b).max(2, keepdims=True)
    emax = 2 if elem == "e2m1" else 8
    e = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - emax
    x = b / 2.0 ** e
    if elem == "e2m1":
        grid = np.unique(np.abs(E2M1)).astype(np.float64)
        idx = np.abs(np.abs(x)[..., None] - grid).argmin(-1)
        q = np.sign(x) * grid[idx]
    else:
        q = torch.from_numpy(np.clip(x, -448, 448)).to(torch.float8_e4m3fn).to(torch.float64).numpy()
    return ((q * 2.0 ** e - b) ** 2).reshape(N, K).sum(1)


def _source(tiny_src: Path) -> dict[str, tuple[str, np.ndarray]]:
    return read_checkpoint(tiny_src, "model.safetensors.index.json")


@pytest.mark.parametrize("target", ["a3", "950dt"])
def test_independent_decoder_reads_every_tensor(target, tiny_src, outputs):
    out = outputs[target]
    src = _source(tiny_src)
    got = read_checkpoint(out, "quant_model_weights.safetensors.index.json")
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert desc["version"] == "1.0.0" and desc["metadata"] == {} and desc["optional"] == {}
    assert desc["group_size"] == (0 if target == "a3" else 32)
    assert desc["model_quant_type"] == ("W8A8_DYNAMIC" if target == "a3" else "W4A8_MXFP")
    # one entry per saved tensor, plus one per MoE layer naming its experts' type (what vLLM-Ascend reads)
    moe_keys = {k for k in desc if k.endswith(".block_sparse_moe.experts.weight")}
    assert set(desc) - set(TOP) - moe_keys == set(got), "description needs exactly one entry per saved tensor"
    assert moe_keys == {f"language_model.model.layers.{i}.block_sparse_moe.experts.weight" for i in range(1, 6)}
    assert all(desc[k] == desc[k.replace(".experts.weight", ".experts.0.w2.weight")] for k in moe_keys)

    quantized = {k[: -len(".weight")] for k, v in desc.items() if k not in TOP and v != "FLOAT" and k.endswith(".weight")}
    seen_types = set()
    for name, (dtype, arr) in src.items():
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base not in quantized:
            assert desc[name] == "FLOAT"
            assert got[name][0] == dtype and np.array_equal(got[name][1].view(np.uint8), arr.view(np.uint8)), name
            continue
        kind = desc[name]
        seen_types.add(kind)
        parts = {s: got[f"{base}.{s}"][1] for s in SUFFIXES if f"{base}.{s}" in got}
        for s in parts:
            assert desc[f"{base}.{s}"] == kind
        w = bf16(arr)
        deq = decode_linear(kind, parts)
        assert deq.shape == w.shape
        sse = ((deq.astype(np.float64) - w) ** 2).sum(1)
        if kind == "W4A8_DYNAMIC":
            step = _int4_step(w.astype(np.float64))[:, None]  # rounding only, never clipped (f32 scale storage)
            assert np.all(np.abs(deq.astype(np.float64) - w) <= 0.5 * step * (1 + 1e-6) + 1e-30), name
            down = name.endswith(("w2.weight", "down_proj.weight"))
            assert parts["scale_bias"].shape == (w.shape[0], 16 if down else 1), name
            np.testing.assert_allclose(parts["scale_bias"], expected_scale_bias(parts, down), rtol=1e-5, atol=1e-6)
            assert not parts["weight_offset"].any()
        elif kind == "W8A8_DYNAMIC":
            assert np.abs(parts["weight"].astype(np.int16)).max() <= 127
            rel = np.sqrt(sse.sum() / (w.astype(np.float64) ** 2).sum())
            assert rel < 0.01, (name, rel)
            assert not parts["weight_offset"].any()
        elif kind == "W4A8_MXFP":
            assert set(parts) == {"weight", "weight_scale"}
            assert np.all(sse <= _naive_mx_sse(w, "e2m1") * (1 + 1e-9) + 1e-30), name
        elif kind == "W8A8_MXFP8":
            assert set(parts) == {"weight", "weight_scale"}
            assert np.all(sse <= _naive_mx_sse(w, "e4m3") * (1 + 1e-6) + 1e-30), name
    assert seen_types == ({"W4A8_DYNAMIC", "W8A8_DYNAMIC"} if target == "a3" else {"W4A8_MXFP", "W8A8_MXFP8"})


@pytest.mark.parametrize("target", ["a3", "950dt"])
def test_roles_and_side_files(target, outputs):
    out = outputs[target]
    desc = json.loads((out / "quant_model_description.json").read_text())
    expert = "language_model.model.layers.1.block_sparse_moe.experts.0"
    quant = "W4A8_DYNAMIC" if target == "a3" else "W4A8_MXFP"
    for w in ("w1", "w2", "w3"):
        assert desc[f"{expert}.{w}.weight"] == quant
    for float_name in ("language_model.model.layers.3.self_attn.kv_b_proj.weight",
                       "language_model.model.layers.1.self_attn.o_proj.weight",
                       "language_model.model.layers.3.self_attn.indexer.wk.weight",
                       "language_model.lm_head.weight", "vision_tower.blocks.0.attn.qkv.weight",
                       "language_model.model.layers.1.block_sparse_moe.gate.weight"):
        assert desc[float_name] == "FLOAT", float_name
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and "quantization_config" not in cfg["text_config"]
    assert (out / "tokenizer_config.json").exists() and (out / "README.md").exists()
    assert not (out / "model.safetensors.index.json").exists()
    prov = json.loads((out / "kimi_quant_provenance.json").read_text())
    assert prov["target"] == target and prov["recipe"]["name"] == "kimi-k3-default"
    # a plain directory: no hub vouched for the shards and --hash-inputs was not given
    assert all(v["sha256"] is None and v["size"] > 0 for v in prov["inputs"].values())
    index = json.loads((out / "quant_model_weights.safetensors.index.json").read_text())
    shard_bytes = sum(len(v[1].tobytes()) for v in read_checkpoint(out, "quant_model_weights.safetensors.index.json").values())
    assert index["metadata"]["total_size"] == shard_bytes
    assert all(f.startswith("quant_model_weights-") for f in set(index["weight_map"].values()))


def test_two_runs_are_byte_identical_across_worker_counts(tiny_src, outputs, tmp_path):
    out = tmp_path / "again"
    convert(str(tiny_src), ConvertOptions(target="950dt", output=out, workers=2, quiet=True, max_shard_size=1_000_000))
    ref = outputs["950dt"]
    names = sorted(p.name for p in ref.iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    for n in names:
        if n == "kimi_quant_journal.jsonl":
            continue  # records completion order, which depends on scheduling
        assert (ref / n).read_bytes() == (out / n).read_bytes(), n


def test_torch_safetensors_loads_output(outputs):
    from safetensors.torch import load_file

    out = outputs["950dt"]
    for f in sorted(out.glob("quant_model_weights-*.safetensors")):
        tensors = load_file(f)
        assert tensors
    fp8 = [t for t in tensors.values() if t.dtype == torch.float8_e4m3fn]
    assert fp8 or any(load_file(f) for f in out.glob("quant_model_weights-*.safetensors"))


def test_hash_inputs_on_a_rerun_fills_the_hashes_without_converting_again(tiny_src, tmp_path):
    out = tmp_path / "nohash"
    opts = dict(target="a3", output=out, workers=1, quiet=True, max_shard_size=1_000_000)
    convert(str(tiny_src), ConvertOptions(**opts))
    prov = json.loads((out / "kimi_quant_provenance.json").read_text())
    assert all(v["sha256"] is None for v in prov["inputs"].values())
    res = convert(str(tiny_src), ConvertOptions(**opts, hash_inputs=True))
    assert res.converted_units == 0  # same conversion: nothing redone, only the hashes added
    prov = json.loads((out / "kimi_quant_provenance.json").read_text())
    assert {f: v["sha256"] for f, v in prov["inputs"].items()} == \
        {f: hashlib.sha256((tiny_src / f).read_bytes()).hexdigest() for f in prov["inputs"]}


# -- the source changes between runs, or overlaps the output ---------------------------------------

def _opts(out: Path, **kw) -> ConvertOptions:
    return ConvertOptions(target="a3", output=out, workers=1, quiet=True, max_shard_size=1_000_000, **kw)


def test_a_source_shard_rewritten_in_place_redoes_the_units_made_from_it(tiny_src, outputs, tmp_path):
    """Same size, new bytes (a repaired or re-downloaded shard): a resumed run must not keep output
    shards made from the old bytes, and must end byte-identical to a fresh conversion."""
    from kimi_quant.source.safetensors import read_header
    from kimi_quant.verify import verify_output

    src = fresh_copy(tiny_src, tmp_path, "src")
    out = tmp_path / "out"
    first = convert(str(src), _opts(out))
    shard = sorted(src.glob("model-*.safetensors"))[0]
    name, info = next((n, t) for n, t in read_header(shard)[0].items() if "experts" in n)
    data = bytearray(shard.read_bytes())
    data[info.start:info.end] = bytes(info.end - info.start)  # zero one expert weight, size unchanged
    shard.write_bytes(bytes(data))
    again = convert(str(src), _opts(out))
    made_from_it = [u for u in first.plan.units if shard.name in u.needs]
    assert again.converted_units == len(made_from_it) > 0 and again.reused_units == len(first.plan.units) - len(made_from_it)
    fresh = tmp_path / "fresh"
    convert(str(src), _opts(fresh))
    assert snapshot(out) == snapshot(fresh)
    verify_output(out)


def test_a_source_shard_rewritten_with_its_mtime_restored_is_noticed(tiny_src, tmp_path):
    """`cp -p` / `rsync -a` over a shard keep size and mtime: the ctime still tells."""
    import os

    src = fresh_copy(tiny_src, tmp_path, "src")
    out = tmp_path / "out"
    first = convert(str(src), _opts(out))
    shard = sorted(src.glob("model-*.safetensors"))[0]
    st = shard.stat()
    shard.write_bytes(shard.read_bytes())  # the same bytes: only the timestamps move
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = convert(str(src), _opts(out))
    assert again.converted_units == len([u for u in first.plan.units if shard.name in u.needs]) > 0


def test_a_changed_config_is_rewritten_and_verifies(tiny_src, tmp_path):
    from kimi_quant.verify import verify_output

    src = fresh_copy(tiny_src, tmp_path, "src")
    out = tmp_path / "out"
    convert(str(src), _opts(out))
    cfg = json.loads((src / "config.json").read_text())
    cfg["note"] = "edited after the first run"
    (src / "config.json").write_text(json.dumps(cfg))
    res = convert(str(src), _opts(out))
    assert res.converted_units == 0
    assert json.loads((out / "config.json").read_text())["note"] == "edited after the first run"
    verify_output(out)


def test_verify_notices_an_edited_copied_file(outputs, tmp_path):
    from kimi_quant.errors import KimiQuantError
    from kimi_quant.verify import verify_output

    out = fresh_copy(outputs["a3"], tmp_path, "out")
    (out / "tokenizer_config.json").write_text('{"edited": true}')
    with pytest.raises(KimiQuantError, match="tokenizer_config.json: sha256 differs"):
        verify_output(out)


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_an_output_overlapping_the_source_is_refused_and_the_source_kept(tiny_src, tmp_path, where):
    from kimi_quant.errors import KimiQuantError

    src = fresh_copy(tiny_src, tmp_path, "src")
    before = snapshot(src)
    out = {"same": src, "inside": src / "out", "parent": tmp_path}[where]
    how = {"same": "is", "inside": "is inside", "parent": "contains"}[where]
    with pytest.raises(KimiQuantError, match=f"--output .* {how} the source directory .*: choose an output directory "
                                             "outside it"):
        convert(str(src), _opts(out, overwrite=True))
    assert snapshot(src) == before


def test_a_validation_report_stands_only_while_the_shards_do(tmp_path):
    """convert --validate records a report; a no-op re-run keeps it, a run that rewrites shards drops it."""
    from conftest import kq
    from kimi_quant.synth import synth as run_synth

    src = run_synth("tiny", tmp_path / "src")
    out = tmp_path / "out"
    args = ("convert", src, "-t", "a3", "-o", out, "--max-shard-size", "1MB", "-q")
    assert kq(*args, "--validate").returncode == 0
    prov = lambda: json.loads((out / "kimi_quant_provenance.json").read_text())  # noqa: E731
    assert "validation" in prov() and (out / "kimi_quant_validation.json").exists()
    assert kq(*args).returncode == 0
    assert "validation" in prov() and (out / "kimi_quant_validation.json").exists()
    shard = sorted(src.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes())  # same bytes, new mtime: its units are redone
    assert kq(*args).returncode == 0
    assert "validation" not in prov() and not (out / "kimi_quant_validation.json").exists()


def test_a_failed_rerun_over_a_complete_output_leaves_it_unloadable(tiny_src, tmp_path):
    """Shards about to be rewritten: the old index and description go first, so a run that fails part
    way never leaves a loadable mix of old and new shards."""
    from conftest import looks_loadable
    from kimi_quant.errors import BadCheckpoint, KimiQuantError
    from kimi_quant.source.safetensors import read_header
    from kimi_quant.verify import verify_output

    src = fresh_copy(tiny_src, tmp_path, "src")
    out = tmp_path / "out"
    convert(str(src), _opts(out))
    assert looks_loadable(out)
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    name, info = next((n, t) for n, t in read_header(shard)[0].items() if "experts" in n and t.dtype == "BF16")
    data = bytearray(shard.read_bytes())
    data[info.start:info.start + 2] = b"\xc0\x7f"  # a bf16 NaN: that unit fails
    shard.write_bytes(bytes(data))
    with pytest.raises(BadCheckpoint, match="NaN"):
        convert(str(src), _opts(out))
    assert not looks_loadable(out)
    with pytest.raises(KimiQuantError, match="incomplete"):
        verify_output(out)
