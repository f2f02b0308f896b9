"""The numba kernels' element rules checked on every input they can see, and the MXFP4 / int4 kernels
against the numpy reference on adversarial matrices (exact ties, saturating blocks, zeros, tiny and
huge values).  Runs in seconds."""

import numpy as np
import pytest
from numba import njit

from kimi_quant.dtypes import bf16_to_f32, f32_to_bf16
from kimi_quant.quant import kernels as kn
from kimi_quant.quant import numerics as nm

from conftest import KERNEL_BUILDS, kernels_build

#: every non-negative finite bf16 bit pattern
ALL_BF16 = np.arange(0, 0x7F80, dtype=np.uint32)


@njit
def _fp4_bytes(words, p, out):
    for i in range(words.shape[0] // 16):
        kn._fp4_block(words, 16 * i, p, out)


def test_e2m1_code_every_bf16_times_every_scale():
    """``_fp4_block`` (float32 lanes, the E2M1 code by float rounding) == numerics.e2m1_round's threshold rule for
    every bf16 magnitude times every scale 2^-e the MX kernel can use (e0 in [-127, 125], e1 = e0 + 1),
    in both nibbles and with both signs (a zero code keeps no sign)."""
    a = bf16_to_f32(ALL_BF16.astype(np.uint16))
    out = np.empty(ALL_BF16.shape[0], np.uint8)
    for e in range(-127, 127):
        p = np.float32(2.0**-e)
        with np.errstate(over="ignore"):  # 2^127 * large bf16 -> inf: still code 7
            want = nm.e2m1_round(a * p)[0]
        signed = np.where(want != 0, want | 8, 0)
        for words, lo, hi in [(ALL_BF16, want, 0), (ALL_BF16 << 16, 0, want),
                              (ALL_BF16 | 0x8000, signed, 0), ((ALL_BF16 | 0x8000) << 16, 0, signed)]:
            _fp4_bytes(words, p, out)
            assert np.array_equal(out, (lo | (hi << 4)).astype(np.uint8)), e


@njit
def _fp4_blocks16(x, sh, out):
    for blk in range(x.shape[0] // 32):
        kn._fp4_block16(x, blk * 32, sh, out)


def test_fp4_block16_every_bf16_times_every_scale():
    """``_fp4_block16`` (E2M1 bytes in 16-bit lanes on the bf16 bits) == the reference for every
    finite bf16 pattern (both signs, -0 included) times every scale 2^-e it is used with
    (e >= FP4_I16_EMIN up to e1 = 126), whether or not that product can occur in a block."""
    x = np.arange(0, 0x10000, dtype=np.uint32).astype(np.uint16)
    x = x[(x & 0x7FFF) < 0x7F80]
    a = bf16_to_f32(x)
    out = np.empty(x.size // 2, np.uint8)
    for e in range(kn.FP4_I16_EMIN, 127):
        _fp4_blocks16(x, np.int32(e << 7), out)
        with np.errstate(over="ignore"):
            c = nm.e2m1_round(np.abs(a) * np.float32(2.0**-e))[0]
        c = np.where((c != 0) & (a < 0), c | 8, c).astype(np.uint8)
        assert np.array_equal(out, nm.pack_nibbles_along_k(c[None])[0]), e


def test_e2m1_code_every_float32_grid_neighbourhood():
    """Around every E2M1 threshold and grid value, the float32 neighbours (ties, one ulp either side)
    and the float32 subnormals / zero / inf, at scale 1."""
    pts = np.float32([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 16, 2.0**100])
    y = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0)),
                        np.float32([1e-45, 2.0**-126, np.inf, 3.4e38])]).astype(np.float32)
    y = y[y >= 0]
    @njit
    def codes(y):
        out = np.empty(y.shape[0], np.uint8)
        for i in range(y.shape[0]):
            out[i] = kn._e2m1_code_f32(y[i])
        return out

    assert np.array_equal(codes(y), nm.e2m1_round(y)[0])


def _adversarial_mx(rng, N=16, nb=24):
    """bf16 [N, nb * 32]: per block a random exponent; elements on the E2M1 grid, on its midpoints
    (exact ties) for both candidate scales, random mantissas, zeros; some blocks saturate, some are
    zero, some tiny (subnormal bf16, clamped e0 = -127), some huge."""
    grid = np.float32([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7])
    w = np.empty((N, nb, 32), np.float32)
    for n in range(N):
        for b in range(nb):
            kind = rng.integers(0, 6)
            e = int(rng.integers(-130, 120))
            if kind == 0:  # ties on the e0 grid and the e1 grid (twice as coarse)
                x = rng.choice(grid, 32) * rng.choice(np.float32([1, 2]), 32)
            elif kind == 1:  # saturating: max in (6, 8) times 2^e, rest ties
                x = rng.choice(grid, 32)
                x[rng.integers(0, 32)] = rng.choice(np.float32([6.5, 7, 7.5, 7.75]))
            elif kind == 2:
                x = rng.standard_normal(32).astype(np.float32)
            elif kind == 3:
                x = np.zeros(32, np.float32)
            elif kind == 4:
                x = np.where(rng.random(32) < 0.7, 0, rng.standard_normal(32)).astype(np.float32)
                e = int(rng.integers(-140, -120))  # tiny: subnormal bf16, e0 clamped
            else:
                x = rng.choice(grid, 32)
                e = int(rng.integers(100, 125))  # huge
            w[n, b] = x * rng.choice(np.float32([-1, 1]), 32) * np.float32(2.0**e) if -149 <= e <= 127 else 0
    u = f32_to_bf16(w.reshape(N, nb * 32))
    sub = rng.random(u.shape) < 0.02  # sprinkle raw subnormal bit patterns
    u[sub] = (rng.integers(0, 0x80, sub.sum()) | (rng.integers(0, 2, sub.sum()) << 15)).astype(np.uint16)
    return u


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("seed", range(4))
def test_mxfp4_kernel_adversarial(seed, build):
    rng = np.random.default_rng(seed)
    for w in [_adversarial_mx(rng), f32_to_bf16((0.02 * rng.standard_normal((32, 512))).astype(np.float32)),
              f32_to_bf16((0.01 * rng.standard_t(2, (32, 512))).astype(np.float32))]:
        code, scale = nm.mx_quantize(bf16_to_f32(w), "e2m1")
        want = nm.pack_nibbles_along_k(code)
        for margin in (kn.MX_SCREEN_MARGIN, np.float32(np.inf)):
            out = np.empty_like(want)
            sc = np.empty_like(scale)
            with kernels_build(build) as k:
                assert k.mxfp4_kernel(w, out, sc, margin) == -1
            assert np.array_equal(sc, scale), (seed, margin)
            assert np.array_equal(out, want), (seed, margin)


@njit
def _range(x):
    return kn._bf16_range(x)


def test_bf16_range_every_pair():
    """``_bf16_range`` (int4 max(w, 0), min(w, 0), max |bits| by integer reductions) on every pair of
    one bf16 pattern (NaN / Inf / -0 included) with a sample of others, against float reductions."""
    rng = np.random.default_rng(5)
    allbits = np.arange(0, 0x10000, dtype=np.uint16)
    others = np.concatenate([np.uint16([0, 0x8000, 0x0001, 0x8001, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80]),
                             rng.integers(0, 0x10000, 24).astype(np.uint16)])
    for o in others:
        for a in (allbits[::1] if o in (0, 0x8000) else allbits[::97]):
            x = np.uint16([a, o])
            hi, lo, m = _range(x)
            f = bf16_to_f32(x)
            mm = int(np.max(x & 0x7FFF))
            assert m == mm, (a, o)
            if mm < 0x7F80:
                assert hi == max(f.max(), 0) and lo == min(f.min(), 0), (a, o)


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("seed", range(3))
def test_int4_kernels_adversarial(seed, build):
    """int4 per row and per group against the reference: zeros, -0, tiny, huge, one-sided rows, ties."""
    from kimi_quant.quant import get_codec

    rng = np.random.default_rng(100 + seed)
    N, K = 24, 256
    rows = []
    for n in range(N):
        kind = n % 6
        e = float(2.0 ** int(rng.integers(-130, 120)))
        if kind == 0:
            x = rng.integers(-16, 17, K) * 0.5 * e
        elif kind == 1:
            x = -np.abs(rng.standard_normal(K)) * e
        elif kind == 2:
            x = np.abs(rng.standard_normal(K)) * e
        elif kind == 3:
            x = np.where(rng.random(K) < 0.8, 0.0, rng.standard_normal(K) * e)
        elif kind == 4:
            x = np.zeros(K)
        else:
            x = rng.standard_normal(K) * e
        rows.append(x)
    w = f32_to_bf16(np.asarray(rows, np.float32))
    w[4] = 0x8000  # a row of -0
    w[5, ::3] = 0x8000
    w[10, :] = rng.integers(0, 0x80, K) | (rng.integers(0, 2, K) << 15)  # subnormal bits only
    for name, group in [("W4A8_DYNAMIC", 0), ("W4A8_DYNAMIC", 64)]:
        codec = get_codec(name, group) if group else get_codec(name)
        for matmul in ("gate", "down"):
            with kernels_build(build):
                fast = codec.quantize_bf16(w, matmul)
            ref = codec.quantize(bf16_to_f32(w), matmul)
            for k in fast:
                assert np.array_equal(fast[k].view(np.uint8), ref[k].view(np.uint8)), (name, group, matmul, k)


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("seed", range(3))
def test_int8_pow2_kernel_adversarial(seed, build):
    """W8A8_DYNAMIC with power-of-two row scales: the kernel against the numpy reference on rows decoded
    from MXFP4 (the data it exists for), subnormal-only rows, zeros and -0, ties, the largest bf16."""
    from kimi_quant.quant import decode_mxfp4_bf16, get_codec

    codec = get_codec("W8A8_DYNAMIC").with_pow2_scale()
    rng = np.random.default_rng(200 + seed)
    codes = rng.integers(0, 256, (24, 64)).astype(np.uint8)
    scales = rng.integers(127 - 120, 127 + 120, (24, 4)).astype(np.uint8)
    w = decode_mxfp4_bf16(codes, scales).copy()
    w[0] = 0
    w[1] = 0x8000
    w[2, :] = rng.integers(0, 0x80, 128) | (rng.integers(0, 2, 128) << 15)  # subnormal bits only
    w[3, :] = np.uint16(0x7F7F)  # the largest finite bf16
    w[4, :] = f32_to_bf16((rng.integers(-254, 255, 128) * 0.5).astype(np.float32))  # .5 ties at s = 1
    w[5, :] = f32_to_bf16((rng.standard_normal(128) * 2.0 ** -133).astype(np.float32))
    with kernels_build(build):
        fast = codec.quantize_bf16(w, None)
    ref = codec.quantize(bf16_to_f32(w), None)
    for k in ref:
        assert np.array_equal(fast[k].view(np.uint8), ref[k].view(np.uint8)), k

