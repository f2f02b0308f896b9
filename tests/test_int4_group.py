"""Per-group int4 (``convert --target a3 --group-size G``): golden bytes, fast path == reference, a plain
numpy reference, GPTQ on the group grid, and the plan / verify / resume rules around it.

The loader side (vLLM-Ascend's real per-group MoE code) is in test_consumer_vllm_ascend.py, msModelSlim's
packing and scale_bias helpers in test_consumer_msmodelslim.py.
"""

from __future__ import annotations

import json
import math
import zlib

import numpy as np
import pytest

from conftest import error_line, kq
from kimi_quant.dtypes import bf16_to_f32, f32_to_bf16
from kimi_quant.quant import dequantize_prefixed, get_codec
from kimi_quant.quant import numerics as nm

from conftest import KERNEL_BUILDS, kernels_build

DESC = "quant_model_description.json"


def both(w_f32, matmul, group):
    """Reference and fast path of per-group W4A8_DYNAMIC (asserting they are bit-identical)."""
    codec = get_codec("W4A8_DYNAMIC", group)
    w_u16 = f32_to_bf16(np.asarray(w_f32, np.float32))
    assert np.array_equal(bf16_to_f32(w_u16), np.asarray(w_f32, np.float32)), "golden inputs must be bf16-exact"
    ref = codec.quantize(bf16_to_f32(w_u16), matmul)
    fast = codec.quantize_bf16(w_u16, matmul)
    specs = codec.out_specs(w_u16.shape, matmul)
    assert list(ref) == list(fast) == list(specs)
    for k in ref:
        assert ref[k].dtype == fast[k].dtype and ref[k].shape == specs[k][1], k
        assert np.array_equal(ref[k].view(np.uint8), fast[k].view(np.uint8)), k
    return fast


# ------------------------------------------------------------------------------------------ golden


def golden_matrix():
    """[4, 64], two groups of 32 per row, each group exercising one rule of the group scale."""
    w = np.zeros((4, 64), np.float32)
    base = np.array([7, -1, 3, 0, -8, 2, 5, -6], np.float32)
    w[0, :32] = np.tile(base, 4) * 0.5  # on the grid of 0.5 (code 7 reached): scale 0.5
    w[0, 32:] = np.tile(base, 4) * 2.0**-10  # another scale in the same row
    w[1, :32] = np.tile([-8, 3, 0, 1], 8) * 0.25  # the negative side dominates: -min/8 = 0.25
    # w[1, 32:] all zero: scale 1.0, codes 0
    w[2, :32] = np.tile([1.0, 0.5, -0.25, 0.0], 8)  # 1/7 is not a float16: rounded up to 1171 * 2^-13
    w[2, 32:] = np.tile([7 * 2.0**-30, 0.0], 16)  # below the float16 range: scale 2^-24, codes 0
    w[3, :32] = np.tile([21 * 2.0**-24, 2.0**-24, 2 * 2.0**-24, 0.0], 8)  # float16 subnormal scale 3 * 2^-24
    w[3, 32:] = np.tile([7 * 2.0**17, -2.0**17], 16)  # above the float16 range: scale saturates at 65504
    return w


def test_group_codec_golden_bytes_gate_and_down():
    w = golden_matrix()
    out = both(w, "gate", 32)
    assert list(out) == ["weight", "weight_scale", "weight_offset", "weight_scale_second", "weight_offset_second",
                         "scale_bias"]
    s = out["weight_scale_second"]
    assert s.dtype == np.float32 and s.shape == (4, 2)
    assert s.tolist() == [[0.5, 2.0**-10], [0.25, 1.0], [1171 * 2.0**-13, 2.0**-24], [3 * 2.0**-24, 65504.0]]
    assert out["weight_scale"].tolist() == [[1.0]] * 4  # the whole scale is in weight_scale_second
    assert not out["weight_offset"].any() and out["weight_offset"].shape == (4, 1)
    assert not out["weight_offset_second"].any() and out["weight_offset_second"].shape == (4, 2)
    q = nm.unpack_int4_along_n(out["weight"])
    assert q[0, :8].tolist() == q[0, 32:40].tolist() == [7, -1, 3, 0, -8, 2, 5, -6]
    assert q[1, :4].tolist() == [-8, 3, 0, 1] and not q[1, 32:].any()
    assert q[2, :4].tolist() == [7, 3, -2, 0] and not q[2, 32:].any()  # 1.0 / (1171 * 2^-13) = 6.996 -> 7
    assert q[3, :4].tolist() == [7, 0, 1, 0]  # 1/3 -> 0, 2/3 -> 1
    assert q[3, 32:34].tolist() == [7, -2]  # 917504 / 65504 = 14.007 clips to 7; -131072 / 65504 -> -2
    # nibbles packed along N: byte[j, k] = q[2j, k] & 0xF | q[2j+1, k] << 4
    assert out["weight"].view(np.uint8)[:, :4].tolist() == [[0x87, 0x3F, 0x03, 0x10], [0x77, 0x03, 0x1E, 0x00]]
    # scale_bias: 8 * sum over groups of (sum of the group's codes) * its scale
    qs = q.reshape(4, 2, 32).sum(axis=2).astype(np.float64)
    expect = 8.0 * (qs * s.astype(np.float64)).sum(axis=1)
    assert out["scale_bias"].shape == (4, 1)
    np.testing.assert_array_equal(out["scale_bias"][:, 0], expect.astype(np.float32))
    assert out["scale_bias"][0, 0] == np.float32(8 * 8 * (0.5 + 2.0**-10))  # codes sum to 8 in each group

    down = both(w, "down", 32)
    assert down["scale_bias"].shape == (4, 16)  # K = 64: 16 chunks of 4, each inside one group
    per_chunk = q.reshape(4, 16, 4).sum(axis=2).astype(np.float64) * np.repeat(s, 8, axis=1)
    np.testing.assert_array_equal(down["scale_bias"], (8.0 * per_chunk).astype(np.float32))
    for k in ("weight", "weight_scale_second"):
        assert np.array_equal(down[k], out[k])
    # the loader's scale: float16(weight_scale * weight_scale_second), here exactly the group scale
    deq = get_codec("W4A8_DYNAMIC", 32).dequantize(out)
    np.testing.assert_array_equal(deq, q.astype(np.float32) * np.repeat(s, 32, axis=1))


def test_chunks_that_straddle_groups():
    """K = 96, G = 32, down: 16 chunks of 6, some across a group boundary (sums split there)."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((6, 96)) * 0.02).astype(np.float32)
    w = bf16_to_f32(f32_to_bf16(w))
    out = both(w, "down", 32)
    q = nm.unpack_int4_along_n(out["weight"]).astype(np.int64)
    s = np.repeat(out["weight_scale_second"].astype(np.float64), 32, axis=1)
    exact = [[math.fsum(q[n, c * 6:(c + 1) * 6] * s[n, c * 6:(c + 1) * 6]) for c in range(16)] for n in range(6)]
    np.testing.assert_array_equal(out["scale_bias"], (8.0 * np.array(exact)).astype(np.float32))


# ------------------------------------------------------------------------------------------ properties

FP16_VALUES = np.sort(np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32))  # +0 .. 65504


def plain_reference(w: np.ndarray, group: int, matmul: str):
    """Written out loop by loop (independent of numerics): per group the smallest scale that clips
    nothing, up to the next float16 value (searched in the table of all of them), codes by rounding,
    scale_bias as the exact sum."""
    N, K = w.shape
    q = np.zeros((N, K), np.int64)
    s = np.zeros((N, K // group), np.float32)
    for n in range(N):
        for g in range(K // group):
            x = w[n, g * group:(g + 1) * group]
            hi, lo = max(float(x.max()), 0.0), min(float(x.min()), 0.0)
            if hi == 0.0 and lo == 0.0:
                s[n, g] = 1.0
            else:
                rule = max(np.float32(hi) / np.float32(7), np.float32(-lo) / np.float32(8))
                i = min(np.searchsorted(FP16_VALUES, rule, side="left"), len(FP16_VALUES) - 1)
                s[n, g] = max(FP16_VALUES[i], 2.0**-24)
            q[n, g * group:(g + 1) * group] = np.clip(np.rint(x / s[n, g]), -8, 7)
    chunks = 16 if matmul == "down" else 1
    L = K // chunks
    qs = q * np.repeat(s.astype(np.float64), group, axis=1)  # exact products
    bias = np.array([[math.fsum(qs[n, c * L:(c + 1) * L]) for c in range(chunks)] for n in range(N)])
    size = np.array([[math.fsum(np.abs(qs[n, c * L:(c + 1) * L])) for c in range(chunks)] for n in range(N)])
    return q, s, 8.0 * bias, 8.0 * size


CASES = [("gauss", lambda r, n, k: r.standard_normal((n, k)) * 0.02),
         ("t2", lambda r, n, k: r.standard_t(2, (n, k)) * 0.01),
         ("wide_range", lambda r, n, k: r.standard_normal((n, k)) * np.exp2(r.integers(-40, 18, (n, k // 32, 1))
                                                                             ).repeat(32, axis=2).reshape(n, k)),
         ("sparse_zero_groups", lambda r, n, k: r.standard_normal((n, k)) * (r.random((n, k // 32, 1)) < 0.5
                                                                              ).repeat(32, axis=2).reshape(n, k))]


@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("matmul", ["gate", "down"])
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_matches_a_plain_reference_and_the_fast_path(group, matmul, case):
    rng = np.random.default_rng(zlib.crc32(f"{group} {matmul} {case}".encode()))
    N, K = 6, 512
    w = bf16_to_f32(f32_to_bf16(dict(CASES)[case](rng, N, K).astype(np.float32)))
    out = both(w, matmul, group)
    q, s, bias, size = plain_reference(w, group, matmul)
    np.testing.assert_array_equal(nm.unpack_int4_along_n(out["weight"]), q)
    np.testing.assert_array_equal(out["weight_scale_second"], s)
    # the exact sum, up to ours being rounded to float32 (and float64 additions: far below that)
    assert np.all(np.abs(out["scale_bias"] - bias) <= 2**-24 * np.abs(bias) + 2**-50 * size)
    # scales are float16 values, so the loader's float16 rounding of weight_scale * weight_scale_second is exact
    assert np.array_equal(out["weight_scale_second"].astype(np.float16).astype(np.float32), out["weight_scale_second"])
    # never clips inside the float16 range: every weight within half a step of its value
    deq = get_codec("W4A8_DYNAMIC", group).dequantize(out)
    step = np.repeat(out["weight_scale_second"], group, axis=1)
    inside = step < 65504
    assert np.all(np.abs(w - deq)[inside] <= 0.5 * step[inside] * (1 + 2**-20))


@pytest.mark.parametrize("build", KERNEL_BUILDS)
def test_fast_path_bit_identical_on_awkward_bits(build):
    """Every finite bf16 bit pattern (subnormals, huge values) and rows of zeros, both roles, all sizes."""
    rng = np.random.default_rng(7)
    w = (rng.integers(0, 0x7F80, (10, 256)) | (rng.integers(0, 2, (10, 256)) << 15)).astype(np.uint16)
    w[3] = 0
    w[5, :128] = 0x8000  # -0.0
    w[6] = rng.integers(0, 0x80, 256).astype(np.uint16)  # subnormal
    for group in nm.INT4_GROUP_SIZES:
        codec = get_codec("W4A8_DYNAMIC", group)
        for matmul in ("up", "down"):
            with kernels_build(build):
                fast = codec.quantize_bf16(w, matmul)
            with np.errstate(over="ignore"):
                ref = codec.quantize(bf16_to_f32(w), matmul)
            for k in fast:
                assert np.array_equal(fast[k].view(np.uint8), ref[k].view(np.uint8)), (group, matmul, k)
    with pytest.raises(nm.NonFiniteWeight, match="row 1, column 5"):
        bad = w.copy()
        bad[1, 5] = 0x7FC0
        with kernels_build(build):
            get_codec("W4A8_DYNAMIC", 64).quantize_bf16(bad, "gate")


def test_group_beats_per_channel_on_weight_error_and_dequantize_prefixed_follows_the_description():
    rng = np.random.default_rng(3)
    w = bf16_to_f32(f32_to_bf16((rng.standard_t(3, (64, 512)) * 0.02).astype(np.float32)))
    err = {}
    for g in (0, 32, 256):
        codec = get_codec("W4A8_DYNAMIC", g)
        out = codec.quantize(w, "up")
        named = {f"m.e.{k}": v for k, v in out.items()}
        deq = dequantize_prefixed("W4A8_DYNAMIC", named, "m.e", group_size=g)
        np.testing.assert_array_equal(deq, codec.dequantize(out))
        err[g] = float(((w - deq) ** 2).sum())
    assert err[32] < err[256] < err[0]
    # read as the loader would under another group_size: a per-group file read per channel is garbage
    named = {f"m.e.{k}": v for k, v in get_codec("W4A8_DYNAMIC", 32).quantize(w, "up").items()}
    with pytest.raises(KeyError, match="weight_scale_second"):
        dequantize_prefixed("W4A8_DYNAMIC", {k: v for k, v in named.items() if "second" not in k}, "m.e", 32)
    with pytest.raises(ValueError, match="weight_scale_second"):
        dequantize_prefixed("W4A8_DYNAMIC", named, "m.e", 64)


def test_gptq_on_the_group_grid():
    """The calibrated path works on per-group grids: same format, codes on the data-free group scales,
    never worse than the data-free codes on the input-weighted error (the guard)."""
    from kimi_quant.quant.gptq import gptq_quantize
    from kimi_quant.quant.gptq_judge import weighted_error

    rng = np.random.default_rng(11)
    N, K = 32, 256
    w = bf16_to_f32(f32_to_bf16((rng.standard_normal((N, K)) * 0.02).astype(np.float32)))
    x = rng.standard_normal((4 * K, K)) * np.exp(rng.standard_normal(K))  # inputs of unequal activity
    h = x.T @ x / len(x)
    codec = get_codec("W4A8_DYNAMIC", 64)
    free = codec.quantize(w, "down")
    cal = gptq_quantize(codec, w, "down", h)
    assert list(cal) == list(free) and all(cal[k].shape == free[k].shape for k in cal)
    np.testing.assert_array_equal(cal["weight_scale_second"], free["weight_scale_second"])
    q = nm.unpack_int4_along_n(cal["weight"])
    np.testing.assert_array_equal(cal["scale_bias"], nm.int4_group_scale_bias(q, cal["weight_scale_second"], "down"))
    e_free = weighted_error(w, codec.dequantize(free), h)
    e_cal = weighted_error(w, codec.dequantize(cal), h)
    assert np.all(e_cal <= e_free * (1 + 1e-9)) and e_cal.sum() < 0.9 * e_free.sum()


# ------------------------------------------------------------------------------------------ plan, CLI, verify


def test_plan_refuses_what_the_loader_cannot_read(tiny_source):
    r = kq("plan", tiny_source, "-t", "a3", "--group-size", "128")  # the tiny experts have K = 64
    line = error_line(r.stderr)
    assert r.returncode != 0 and "cannot be W4A8_DYNAMIC: --group-size 128 needs K divisible by it (got K=64" in line
    r = kq("plan", tiny_source, "-t", "950dt", "--group-size", "32")
    assert "--group-size is per-group int4 (W4A8_DYNAMIC) for --target a3" in error_line(r.stderr)
    r = kq("plan", tiny_source, "-t", "a3", "--group-size", "48")
    assert "must be one of 32, 64, 128, 256" in error_line(r.stderr)
    r = kq("plan", tiny_source, "-t", "a3", "--group-size", "-1")
    assert r.returncode == 2 and "--group-size" in error_line(r.stderr)
    r = kq("plan", tiny_source, "-t", "a3", "--group-size", "32")
    assert r.returncode == 0, r.stderr
    # read in vLLM-Ascend's code: 0.27.1rc1+ raises at init on group_size > 0 (tests/test_consumer_vllm_ascend.py)
    assert "loaders  vLLM-Ascend 0.23.x loads per-group int4 experts (with --enable-expert-parallel; without " \
           "it, at tp > 1, its loader fails on them); from 0.27.1rc1 on it refuses them" in r.stdout
    # and SGLang 0.5.23 drops the group scales without a word (tests/test_consumer_sglang.py, the xfail)
    assert "SGLang (0.5.23) loads them without a word but drops the group scales" in r.stdout
    assert "int4 per group of 32" in r.stdout.splitlines()[0]


def test_recipe_group_size_and_the_option_that_overrides_it(tiny_source, tmp_path):
    from importlib import resources

    text = resources.files("kimi_quant.recipe").joinpath("kimi_k3.toml").read_text()
    recipe = tmp_path / "r.toml"
    recipe.write_text(text.replace("# group_size = 256", "group_size = 32"))
    r = kq("plan", tiny_source, "-t", "a3", "--recipe", recipe)
    assert r.returncode == 0 and "int4 per group of 32" in r.stdout.splitlines()[0], r.stderr
    r = kq("plan", tiny_source, "-t", "a3", "--recipe", recipe, "--group-size", "0")
    assert r.returncode == 0 and "int4 per group" not in r.stdout, r.stderr
    recipe.write_text(text.replace("# group_size = 256", "group_size = 'big'"))
    r = kq("plan", tiny_source, "-t", "a3", "--recipe", recipe)
    assert "group_size must be a non-negative integer" in error_line(r.stderr)


@pytest.fixture(scope="module")
def grouped(tiny_source, tmp_path_factory):
    out = tmp_path_factory.mktemp("group") / "out"
    r = kq("convert", tiny_source, "-t", "a3", "--group-size", "32", "-o", out, "-q", "--max-shard-size", "500KB")
    assert r.returncode == 0, r.stderr
    # said before the work, even with -q: the newer loaders refuse what this writes
    assert "warning: --group-size 32: vLLM-Ascend 0.23.x loads per-group int4 experts (with --enable-expert-" \
           in r.stderr.splitlines()[0] and "from 0.27.1rc1 on it refuses them" in r.stderr.splitlines()[0], r.stderr
    assert "SGLang (0.5.23)" in r.stderr.splitlines()[0] and "what all of them load" in r.stderr.splitlines()[0]
    return out


def test_convert_writes_the_per_group_layout_and_verify_checks_it(grouped, tmp_path):
    import shutil

    from safetensors.torch import load_file

    desc = json.loads((grouped / DESC).read_text())
    assert desc["group_size"] == 32 and desc["version"] == "1.0.0" and desc["model_quant_type"] == "W8A8_DYNAMIC"
    e = "language_model.model.layers.1.block_sparse_moe.experts.0.w2"
    for suffix in ("weight", "weight_scale", "weight_offset", "weight_scale_second", "weight_offset_second",
                   "scale_bias"):
        assert desc[f"{e}.{suffix}"] == "W4A8_DYNAMIC"
    wm = json.loads((grouped / "quant_model_weights.safetensors.index.json").read_text())["weight_map"]
    t = load_file(grouped / wm[f"{e}.weight_scale_second"])
    n2, k = t[f"{e}.weight"].shape
    assert tuple(t[f"{e}.weight_scale_second"].shape) == (n2 * 2, k // 32)
    shared = "language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj"
    assert desc[f"{shared}.weight"] == "W8A8_DYNAMIC" and f"{shared}.weight_scale_second" not in desc  # unaffected
    prov = json.loads((grouped / "kimi_quant_provenance.json").read_text())
    assert prov["group_size"] == 32
    card = (grouped / "README.md").read_text()
    assert "per group of 32 inputs (`--group-size 32`)" in card and "from 0.27.1rc1 on it refuses them" in card
    assert "SGLang (0.5.23) loads them without a word but drops the group scales" in card
    r = kq("verify", grouped)
    assert r.returncode == 0, r.stderr

    def broken(edit) -> str:
        d = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        shutil.copytree(grouped, d)
        dd = json.loads((d / DESC).read_text())
        edit(dd)
        (d / DESC).write_text(json.dumps(dd))
        r = kq("verify", d, "--no-rehash")
        assert r.returncode != 0
        return error_line(r.stderr)

    assert "W4A8_DYNAMIC needs F32[" in broken(lambda d: d.update(group_size=64))
    assert "per-group scales but group_size is 0" in broken(lambda d: d.update(group_size=0))
    assert "group_size 48" in broken(lambda d: d.update(group_size=48))
    assert "not a non-negative integer" in broken(lambda d: d.update(group_size="32"))


def test_validate_reads_the_per_group_output(grouped, tiny_source):
    from kimi_quant.runtime.weights import QuantizedLoader

    from safetensors.torch import load_file

    loader = QuantizedLoader(grouped)
    e = "language_model.model.layers.1.block_sparse_moe.experts.3.w1"
    w, _ = loader.tensor(e + ".weight")
    wm = json.loads((grouped / "quant_model_weights.safetensors.index.json").read_text())["weight_map"]
    parts = {k.rsplit(".", 1)[1]: v.numpy() for k, v in load_file(grouped / wm[e + ".weight"]).items()
             if k.startswith(e + ".")}
    np.testing.assert_array_equal(w.numpy(), get_codec("W4A8_DYNAMIC", 32).dequantize(parts))
    wm = json.loads((tiny_source / "model.safetensors.index.json").read_text())["weight_map"]
    src = load_file(tiny_source / wm[e + ".weight"])[e + ".weight"].float().numpy()
    assert float(np.linalg.norm(w.numpy() - src) / np.linalg.norm(src)) < 0.2


def test_resume_refuses_a_changed_group_size(grouped, tmp_path):
    import shutil

    d = tmp_path / "out"
    shutil.copytree(grouped, d)
    src = json.loads((d / "kimi_quant_journal.jsonl").read_text().splitlines()[0])["options"]["source"]
    for args, was, now in ((["--group-size", "64"], "was 32", "now 64"), ([], "was 32", "now not given")):
        r = kq("convert", src, "-t", "a3", *args, "-o", d, "-q", "--max-shard-size", "500KB")
        line = error_line(r.stderr)
        assert r.returncode != 0 and f"--group-size {was}, {now}" in line and "pass --group-size 32" in line
    r = kq("convert", src, "-t", "a3", "--group-size", "32", "-o", d, "-q", "--max-shard-size", "500KB")
    assert r.returncode == 0, r.stderr  # the same options: nothing to redo


def test_calibrate_with_group_size(tmp_path):
    """--calibrate --group-size: GPTQ on the group grid inside the streaming pipeline; verifies, and on
    held-out text the per-group output is closer to BF16 than the per-channel one."""
    import torch

    from kimi_quant.calibrate import CalibConfig
    from kimi_quant.convert import ConvertOptions, convert
    from kimi_quant.synth import synth
    from kimi_quant.validate.run import run_validation
    from kimi_quant.verify import verify_output

    torch.set_num_threads(1)
    src = synth("tiny", tmp_path / "tiny-bf16")
    kl = {}
    for g in (0, 32):
        out = tmp_path / f"cal-g{g}"
        res = convert(str(src), ConvertOptions(target="a3", output=out, quiet=True, workers=1, group_size=g,
                                               calibrate=CalibConfig(tokens=2048)))
        assert res.calibration["stats"]["gptq_tensors"] > 0
        verify_output(out)
        assert json.loads((out / DESC).read_text())["group_size"] == g
        report = run_validation(src, out, progress=False)
        kl[g] = report["logits"]["kl"]  # KL(BF16 || quantized) of the next-token distributions
    assert kl[32] <= kl[0], kl
