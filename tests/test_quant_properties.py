"""Properties of the codecs: fast path == reference bit for bit, int4 never clips, MX never worse than the OCP rule, codes in range."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_quant.dtypes import bf16_to_f32, f32_to_bf16
from kimi_quant.quant import get_codec
from kimi_quant.quant import numerics as nm

from conftest import KERNEL_BUILDS, kernels_build

SCHEMES = [("W4A8_DYNAMIC", "gate"), ("W4A8_DYNAMIC", "down"), ("W8A8_DYNAMIC", None), ("W4A8_MXFP", None), ("W8A8_MXFP8", None)]


def _bf16(x):
    return f32_to_bf16(np.asarray(x, np.float32))


def edge_matrices():
    """Seeded bf16 matrices covering the awkward cases (name, uint16 [N, K])."""
    rng = np.random.default_rng(1234)
    out = []
    g = rng.standard_normal((16, 128)).astype(np.float32)
    out.append(("gauss", _bf16(0.02 * g)))
    out.append(("t3", _bf16(0.01 * rng.standard_t(3, (16, 128)))))
    z = _bf16(0.02 * g)
    z[::3] = 0
    z[1, :64] = 0
    out.append(("zeros", z))
    out.append(("tiny_subnormal", rng.integers(0, 0x80, (8, 64)).astype(np.uint16) | (rng.integers(0, 2, (8, 64)).astype(np.uint16) << 15)))
    out.append(("near_min_normal", _bf16(rng.standard_normal((8, 64)) * 2.0**-125)))
    out.append(("huge", _bf16(rng.standard_normal((8, 64)) * 1e37)))
    out.append(("all_finite_bits", (rng.integers(0, 0x7F80, (16, 96)) | (rng.integers(0, 2, (16, 96)) << 15)).astype(np.uint16)))
    o = _bf16(0.01 * rng.standard_normal((8, 128)))
    o[np.arange(8), rng.integers(0, 128, 8)] = _bf16(np.float32([5.0] * 8))
    out.append(("outliers", o))
    # ties: integers and half-integers times powers of two, on every grid
    t = rng.integers(-16, 17, (16, 64)).astype(np.float32) * np.float32(0.25) * np.exp2(rng.integers(-8, 8, (16, 1))).astype(np.float32)
    out.append(("ties", _bf16(t)))
    e = rng.choice(np.float32([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 5, 6, 7, 7.5, 448, 464, 480]), (8, 64))
    out.append(("mx_grid_ties", _bf16(e * rng.choice([-1, 1], (8, 64)))))
    out.append(("constant_rows", _bf16(np.repeat(rng.standard_normal((8, 1)), 64, axis=1))))
    return out


EDGE = edge_matrices()


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("name,matmul", SCHEMES)
@pytest.mark.parametrize("case", [c[0] for c in EDGE])
def test_fast_path_bit_identical_edge_cases(name, matmul, case, build):
    w = dict(EDGE)[case]
    codec = get_codec(name)
    with kernels_build(build):
        fast = codec.quantize_bf16(w, matmul)
    ref = codec.quantize(bf16_to_f32(w), matmul)
    specs = codec.out_specs(w.shape, matmul)
    assert fast.keys() == ref.keys() == specs.keys()
    for k in fast:
        assert fast[k].shape == specs[k][1]
        assert np.array_equal(fast[k].view(np.uint8), ref[k].view(np.uint8)), (case, k)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 6),
    kb=st.integers(1, 4),
    log_scale=st.integers(-30, 30),
    heavy=st.booleans(),
)
def test_fast_path_bit_identical_random(seed, n, kb, log_scale, heavy):
    rng = np.random.default_rng(seed)
    N, K = 2 * n, 32 * kb
    x = rng.standard_t(2, (N, K)) if heavy else rng.standard_normal((N, K))
    w = _bf16(x * 2.0**log_scale)
    for name, matmul in SCHEMES:
        codec = get_codec(name)
        ref = codec.quantize(bf16_to_f32(w), matmul)
        for build in KERNEL_BUILDS:
            with kernels_build(build):
                fast = codec.quantize_bf16(w, matmul)
            for k in fast:
                assert np.array_equal(fast[k].view(np.uint8), ref[k].view(np.uint8)), (build, name, k)


def _row_sse(w, deq):
    return ((w.astype(np.float64) - deq.astype(np.float64)) ** 2).sum(axis=1)


def _block_sse(w, deq):
    d = (w.astype(np.float64) - deq.astype(np.float64)) ** 2
    return d.reshape(w.shape[0], -1, nm.BLOCK).sum(axis=2)


@pytest.mark.parametrize("case", [c[0] for c in EDGE])
def test_int4_rounds_never_clips_and_codes_in_range(case):
    """The int4 scale is the smallest that clips nothing: every weight is within half a step of its
    code (rounding only; the largest weights, which carry the layer's output, are never cut), the
    step is never coarser than the absmax rule's, and it is exactly max(w)/7 or -min(w)/8."""
    w = bf16_to_f32(dict(EDGE)[case])
    codec = get_codec("W4A8_DYNAMIC")
    out = codec.quantize(w, "gate")
    q = nm.unpack_int4_along_n(out["weight"]).astype(np.float64)
    assert q.min() >= -8 and q.max() <= 7
    s = out["weight_scale"][:, 0]
    assert np.isfinite(s).all() and (s > 0).all()
    nz = np.abs(w).max(axis=1) > 0
    sd = s.astype(np.float64)[:, None]
    err = np.abs(w.astype(np.float64) - q * sd)
    assert (err[nz] <= 0.5 * sd[nz] * (1 + 2.0**-20)).all()
    hi = np.maximum(w.max(axis=1), 0)
    lo = np.minimum(w.min(axis=1), 0)
    tol = 1 + 2.0**-22, 8 * 2.0**-149  # float32 rounding of s (absolute where s is subnormal)
    assert (hi[nz] <= 7 * sd[nz, 0] * tol[0] + tol[1]).all() and (-lo[nz] <= 8 * sd[nz, 0] * tol[0] + tol[1]).all()
    exact = (s == (hi / np.float32(7)).astype(np.float32)) | (s == (-lo / np.float32(8)).astype(np.float32))
    assert exact[nz].all()
    _, sa = nm.int4_absmax_quantize(w)
    assert (s <= sa).all()


def test_int4_negative_dominant_rows_use_code_minus_8():
    """Rows whose most negative weight needs the larger step (-min/8 > max/7) get that step and
    use code -8, a step below the absmax rule's; rows whose largest magnitude is positive keep
    absmax / 7.  Weight MSE is only a diagnostic (not asserted): the rule was chosen on model
    output (scripts/bench_quality.py)."""
    w = bf16_to_f32(_bf16(0.02 * np.random.default_rng(5).standard_normal((64, 1024))))
    q, s = nm.int4_quantize(w)
    _, sa = nm.int4_absmax_quantize(w)
    hi, lo = w.max(axis=1), w.min(axis=1)
    by_neg = -lo / np.float32(8) > hi / np.float32(7)
    pos = hi >= -lo
    assert by_neg.any() and pos.any()
    np.testing.assert_array_equal(s[by_neg], -lo[by_neg] / np.float32(8))
    assert (q[by_neg].min(axis=1) == -8).all() and (s[by_neg] < sa[by_neg]).all()
    np.testing.assert_array_equal(s[pos], sa[pos])


@pytest.mark.parametrize("case", [c[0] for c in EDGE])
def test_int8_codes_and_scale(case):
    w = bf16_to_f32(dict(EDGE)[case])
    out = get_codec("W8A8_DYNAMIC").quantize(w)
    assert out["weight"].min() >= -127
    s = out["weight_scale"][:, 0]
    assert np.isfinite(s).all() and (s > 0).all()
    amax = np.abs(w).max(axis=1)
    assert np.array_equal(s[amax > 0], (amax[amax > 0] / np.float32(127)).astype(np.float32))


@pytest.mark.parametrize("name,naive_fn", [("W4A8_MXFP", "mxfp4"), ("W8A8_MXFP8", "mxfp8")])
@pytest.mark.parametrize("case", [c[0] for c in EDGE])
def test_mx_never_worse_than_ocp_rule(name, naive_fn, case):
    w = bf16_to_f32(dict(EDGE)[case])
    codec = get_codec(name)
    out = codec.quantize(w)
    scale = out["weight_scale"]
    assert scale.max() <= 254
    if name == "W8A8_MXFP8":
        assert not np.isin(out["weight"] & 0x7F, [0x7F]).any()
        nc, ns = nm.mxfp8_ocp_quantize(w)
        naive = nm.mx_dequantize(nm.e4m3_to_f32(nc), ns)
    else:
        nc, ns = nm.mxfp4_ocp_quantize(w)
        naive = nm.mx_dequantize(nm.e2m1_to_f32(nc), ns)
    # the chosen exponent is the OCP one or one above it
    d = scale.astype(int) - ns.astype(int)
    assert np.isin(d, [0, 1]).all()
    deq = codec.dequantize(out)
    sse, base = _block_sse(w, deq), _block_sse(w, naive)
    assert (sse <= base * (1 + 1e-12) + 1e-300).all()


def test_mx_roundtrip_error_small():
    w = bf16_to_f32(_bf16(0.02 * np.random.default_rng(7).standard_normal((16, 256))))
    for name, tol in [("W4A8_MXFP", 0.15), ("W8A8_MXFP8", 0.04), ("W8A8_DYNAMIC", 0.02), ("W4A8_DYNAMIC", 0.15)]:
        codec = get_codec(name)
        deq = codec.dequantize(codec.quantize_bf16(_bf16(w), "up"))
        rel = np.sqrt(((w - deq) ** 2).sum() / (w**2).sum())
        assert rel < tol, (name, rel)


@pytest.mark.parametrize("build", KERNEL_BUILDS)
def test_fast_path_bit_identical_seeded_sweep(build):
    for seed in range(60):
        rng = np.random.default_rng(10_000 + seed)
        N, K = 2 * int(rng.integers(1, 24)), 32 * int(rng.integers(1, 24))
        kind = seed % 5
        if kind == 0:
            x = rng.standard_normal((N, K)) * 2.0 ** int(rng.integers(-40, 40))
        elif kind == 1:
            x = rng.standard_t(1.5, (N, K)) * 2.0 ** int(rng.integers(-40, 40))
        elif kind == 2:
            x = rng.integers(-20, 21, (N, K)) * 2.0 ** int(rng.integers(-12, 4))
        elif kind == 3:
            x = np.where(rng.random((N, K)) < 0.9, 0, rng.standard_normal((N, K)))
        if kind == 4:
            w = (rng.integers(0, 0x7F80, (N, K)) | (rng.integers(0, 2, (N, K)) << 15)).astype(np.uint16)
        else:
            w = _bf16(x)
        for name, matmul in SCHEMES:
            codec = get_codec(name)
            with kernels_build(build):
                fast = codec.quantize_bf16(w, matmul)
            ref = codec.quantize(bf16_to_f32(w), matmul)
            for k in fast:
                assert np.array_equal(fast[k].view(np.uint8), ref[k].view(np.uint8)), (seed, name, k)


def test_mx_sse_screen_agrees_with_exact_path():
    """The MX kernels decide most saturating blocks by a float32 SSE screen with a relative margin;
    with a huge margin every such block takes the exact float64 tree path.  Both must match the reference."""
    from kimi_quant.quant import kernels as kn

    rng = np.random.default_rng(99)
    cases = [_bf16(0.02 * rng.standard_normal((8, 512))), _bf16(0.01 * rng.standard_t(2, (8, 512)))]
    cases += [w for _, w in EDGE if w.shape[1] % 32 == 0]
    for w in cases:
        for elem, kern, pack in [("e2m1", kn.mxfp4_kernel, True), ("e4m3", kn.mxfp8_kernel, False)]:
            code, scale = nm.mx_quantize(bf16_to_f32(w), elem)
            want = nm.pack_nibbles_along_k(code) if pack else code
            for margin in (np.float32(2.0**-12), np.float32(np.inf)):  # inf: the screen never decides
                out = np.empty_like(want)
                sc = np.empty_like(scale)
                assert kern(w, out, sc, margin) == -1
                assert np.array_equal(out, want) and np.array_equal(sc, scale), (elem, margin)


def test_mx_element_error_helpers_exhaustive():
    """The kernels' E2M1 / E4M3 rounding-error helpers equal y - round(y) of the reference for every
    bf16 magnitude in the range they are used on (E2M1: y < 8; E4M3: y < 512)."""
    from numba import njit

    from kimi_quant.quant import kernels as kn

    @njit
    def errs(y, fp8):
        out = np.empty_like(y)
        for i in range(y.shape[0]):
            out[i] = kn._e4m3_err(y[i]) if fp8 else kn._e2m1_err(y[i])
        return out

    y = bf16_to_f32(np.arange(0, 0x7F80, dtype=np.uint16))
    for fp8, lim, round_fn in [(False, 8.0, nm.e2m1_round), (True, 512.0, nm.e4m3_round)]:
        ys = y[y < lim]
        want = ys - round_fn(ys)[1]
        assert np.array_equal(errs(ys, fp8).view(np.uint32), want.view(np.uint32)), fp8


def test_every_codec_declares_the_activation_quantizer_the_forward_simulates():
    from kimi_quant.quant import REGISTRY
    from kimi_quant.runtime.forward import ACT_QUANT

    assert {name: c.activation for name, c in REGISTRY.items()} == {
        "W4A8_DYNAMIC": "int8", "W8A8_DYNAMIC": "int8", "W4A8_MXFP": "mxfp8", "W8A8_MXFP8": "mxfp8"}
    assert {c.activation for c in REGISTRY.values()} <= set(ACT_QUANT)
