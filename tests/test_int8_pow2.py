"""W8A8_DYNAMIC with power-of-two row scales (``get_codec("W8A8_DYNAMIC").with_pow2_scale()``): a plain per-row
reference, exactness on weights decoded from MXFP4, and the unchanged on-disk format."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_quant.dtypes import bf16_to_f32, f32_to_bf16
from kimi_quant.quant import get_codec
from kimi_quant.quant import numerics as nm
from kimi_quant.quant.gptq import gptq_quantize

POW2 = get_codec("W8A8_DYNAMIC").with_pow2_scale()
PLAIN = get_codec("W8A8_DYNAMIC")


def reference_scale(row: np.ndarray) -> float:
    """One row, in Python floats: the smallest power of two 2^e (e >= -149) with max|w| / 2^e <= 127."""
    amax = max(abs(float(v)) for v in row)
    if amax == 0:
        return 1.0
    e = -149
    while amax / 2.0**e > 127:
        e += 1
    return 2.0**e


def mxfp4_rows(rng, n: int, k: int, span: int) -> np.ndarray:
    """float32 [n, k] of MXFP4 values: random E2M1 codes, one exponent per 32-block within ``span`` of the row's
    largest, that block holding a 6 or a 4 (as the OCP rule leaves every block)."""
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    vals = nm.e2m1_to_f32(codes).reshape(n, k // 32, 32)
    vals[:, :, 0] = rng.choice(np.float32([6.0, -6.0, 4.0, -4.0]), (n, k // 32))
    top = rng.integers(-20, 10, (n, 1))
    exps = top - rng.integers(0, span + 1, (n, k // 32))
    exps[:, 0] = top[:, 0]
    return (vals * np.exp2(exps)[..., None].astype(np.float32)).reshape(n, k).astype(np.float32)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), log_mag=st.integers(-140, 120), n=st.integers(1, 6), k=st.integers(1, 70))
def test_matches_plain_reference(seed, log_mag, n, k):
    rng = np.random.default_rng(seed)
    w = bf16_to_f32(f32_to_bf16((rng.standard_normal((n, k)) * 2.0**log_mag).astype(np.float32)))
    w[rng.random((n, k)) < 0.1] = 0
    if n > 1:
        w[0] = 0  # an all-zero row
    out = POW2.quantize(w)
    s = out["weight_scale"][:, 0]
    for i in range(n):
        assert s[i] == np.float32(reference_scale(w[i]))
        want = [max(-127, min(127, round(float(v) / float(s[i])))) for v in w[i]]  # round() is half to even
        assert out["weight"][i].tolist() == want
    assert (np.abs(out["weight"].astype(np.int32)) <= 127).all()
    assert not out["weight_offset"].any()
    np.testing.assert_array_equal(out["weight_scale"], out["weight_scale"].astype(np.float64).astype(np.float32))
    assert all(math.frexp(float(v))[0] == 0.5 for v in s)  # powers of two: exact in the loader's BF16


def test_mxfp4_rows_within_three_exponents_are_exact():
    rng = np.random.default_rng(7)
    w = mxfp4_rows(rng, 64, 256, span=3)
    back = PLAIN.dequantize(POW2.quantize(w))  # read back by the unchanged W8A8_DYNAMIC dequantize
    np.testing.assert_array_equal(back, w)
    assert not np.array_equal(PLAIN.dequantize(PLAIN.quantize(w)), w)  # absmax / 127 is not exact on them


def test_wider_rows_lose_only_their_smallest_blocks():
    rng = np.random.default_rng(8)
    w = mxfp4_rows(rng, 32, 256, span=6)
    back = PLAIN.dequantize(POW2.quantize(w))
    s = POW2.quantize(w)["weight_scale"]
    assert (np.abs(back - w) <= s / 2).all()
    blocks = nm.mx_blocks(w)
    amax = np.abs(blocks).max(axis=2)
    top = nm.floor_log2(np.abs(w).max(axis=1))
    near = np.where(amax > 0, nm.floor_log2(np.where(amax > 0, amax, 1).astype(np.float32)), -999) >= top[:, None] - 3
    np.testing.assert_array_equal(nm.mx_blocks(back)[near], blocks[near])


def test_same_format_and_fast_path_as_the_reference():
    rng = np.random.default_rng(9)
    w = mxfp4_rows(rng, 8, 96, span=5)
    u16 = f32_to_bf16(w)
    assert np.array_equal(bf16_to_f32(u16), w)
    fast, ref = POW2.quantize_bf16(u16), POW2.quantize(w)
    assert POW2.out_specs(w.shape, None) == PLAIN.out_specs(w.shape, None)
    assert fast.keys() == ref.keys() == set(PLAIN.out_specs(w.shape, None))
    for key in ref:
        assert fast[key].dtype == ref[key].dtype and np.array_equal(fast[key], ref[key])
    assert POW2.name == "W8A8_DYNAMIC" and get_codec("W8A8_DYNAMIC") is PLAIN and not PLAIN.pow2_scale


def test_calibrated_path_keeps_power_of_two_scales():
    rng = np.random.default_rng(10)
    w = mxfp4_rows(rng, 16, 64, span=6)
    x = rng.standard_normal((256, 64)).astype(np.float64)
    out = gptq_quantize(POW2, w, None, x.T @ x / 256)
    assert all(math.frexp(float(v))[0] == 0.5 for v in out["weight_scale"][:, 0])
