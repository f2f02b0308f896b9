"""Coordinate descent after GPTQ (``gptq_refine``) and GPTQ on each row's best scales (``gptq_finalists``)."""

import numpy as np
import pytest

from kimi_quant.quant import get_codec
from kimi_quant.quant import numerics as nm
from kimi_quant.quant.base import Grid
from kimi_quant.quant.gptq import GPTQConfig, gptq_quantize
from kimi_quant.quant.gptq_judge import values_of, weighted_error
from kimi_quant.quant.gptq_refine import descend, objective


def _problem(N=24, K=64, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((4 * K, K))
    x[:, :3] *= 5
    x[:, 7] = 0.0  # a dead input
    H = x.T @ x / len(x)
    scale = (np.abs(w).max(axis=1, keepdims=True) / 7).astype(np.float32)
    codes = np.clip(np.rint(w / scale), -8, 7).astype(np.int16)
    return w, H, Grid(scale, K, "int", -8, 7), codes


def _reference(w, codes, scale, H, passes, qmin=-8, qmax=7):
    """The same descent, written plainly in float64: the gradient recomputed from scratch at every code."""
    c = codes.astype(np.float64).copy()
    for n in range(len(w)):
        s = float(scale[n, 0])
        for _ in range(passes):
            moved = False
            for k in range(w.shape[1]):
                if H[k, k] <= 0:
                    continue
                g = H[k] @ (w[n].astype(np.float64) - np.float32(1) * (c[n] * s).astype(np.float32))
                cn = min(max(c[n, k] + np.rint(g / (s * H[k, k])), qmin), qmax)
                step = (cn - c[n, k]) * s
                if step != 0 and 2 * step * g - step * step * H[k, k] > 0:
                    c[n, k] = cn
                    moved = True
            if not moved:
                break
    return c.astype(np.int16)


@pytest.mark.parametrize("passes", [1, 2])
def test_descent_matches_the_plain_reference_and_never_raises_the_error(passes):
    w, H, grid, codes = _problem()
    Hs = objective(H, 0.0)
    got, gain = descend(w, codes, grid, Hs, passes)
    want = _reference(w, codes, grid.scale, Hs, passes)
    assert np.array_equal(got, want)
    before = weighted_error(w, values_of(codes, grid), H)
    after = weighted_error(w, values_of(got, grid), H)
    assert (after <= before * (1 + 1e-9)).all() and after.sum() < 0.95 * before.sum()
    np.testing.assert_allclose(before - after, gain, rtol=1e-4, atol=1e-6 * before.max())
    assert np.array_equal(got[:, 7], codes[:, 7])  # the dead input's codes are left alone
    assert got.min() >= -8 and got.max() <= 7


def test_descent_keeps_a_local_minimum():
    w, H, grid, codes = _problem(seed=1)
    Hs = objective(H, 0.0)
    once, _ = descend(w, codes, grid, Hs, 50)
    again, gain = descend(w, once, grid, Hs, 1)
    assert np.array_equal(once, again) and (gain == 0).all()


def test_objective_adds_the_shift_on_live_inputs_only():
    _, H, _, _ = _problem()
    Hs = objective(H, 0.5)
    assert Hs[7, 7] == 0 and np.allclose(np.diagonal(Hs)[:7], np.diagonal(H)[:7] + 0.5)


def test_refined_and_finalist_gptq_lower_the_error_on_an_mxfp4_grid_weight():
    rng = np.random.default_rng(3)
    N, K = 64, 256
    w = 0.02 * rng.standard_normal((N, K)) * np.exp2(rng.integers(-3, 1, (N, K // 32))).repeat(32, axis=1)
    codes, scales = nm.mxfp4_ocp_quantize(w.astype(np.float32))
    w = nm.mx_dequantize(nm.e2m1_to_f32(codes), scales).astype(np.float32)
    x = rng.standard_normal((4 * K, K))
    x[:, rng.integers(0, K, 4)] *= 10
    H = x.T @ x / len(x)
    codec = get_codec("W4A8_DYNAMIC")
    base = dict(pow2_scales=True)

    def err(cfg):
        return weighted_error(w, codec.dequantize(gptq_quantize(codec, w, "gate", H, cfg)), H).sum()

    plain = err(GPTQConfig(**base))
    refined = err(GPTQConfig(**base, refine_passes=2))
    two = err(GPTQConfig(**base, gptq_finalists=2))
    both = err(GPTQConfig(**base, gptq_finalists=2, refine_passes=2))
    assert refined < 0.97 * plain and two <= plain * (1 + 1e-6) and both <= refined * (1 + 1e-6)


def test_new_fields_are_checked():
    with pytest.raises(ValueError, match="refine_passes"):
        GPTQConfig(refine_passes=-1)
    with pytest.raises(ValueError, match="gptq_finalists"):
        GPTQConfig(gptq_finalists=0)


def test_hessian_shrink_keeps_the_diagonal_and_scales_the_rest():
    from kimi_quant.quant.gptq import shrunk

    _, H, _, _ = _problem()
    S = shrunk(H, 0.25)
    assert np.array_equal(np.diagonal(S), np.diagonal(H))
    off = ~np.eye(len(H), dtype=bool)
    np.testing.assert_allclose(S[off], 0.75 * H[off])
    with pytest.raises(ValueError, match="hessian_shrink"):
        GPTQConfig(hessian_shrink=1.0)
