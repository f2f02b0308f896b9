"""Our ascendV1 bytes against msModelSlim 26.1.0's own packing code (the tool whose output the loaders read).

msModelSlim's ``save/utils/pack.py`` (``w4a8_pack_int4``, ``process_scale``, ``pack_fp4_to_uint8``) only
needs torch, so it is imported straight from the pinned wheel (``consumer_sources.py``); the rest of
msModelSlim (which pulls heavy dependencies) is never imported.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import consumer_sources as cs
from kimi_quant.quant import get_codec
from kimi_quant.quant import numerics as nm

PACK_PY = "msmodelslim/core/quant_service/modelslim_v1/save/utils/pack.py"
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


@pytest.fixture(scope="module")
def ms():
    try:
        code = cs.msmodelslim_file(PACK_PY).decode()
    except cs.Unavailable as e:
        pytest.skip(str(e))
    mod = types.ModuleType("msmodelslim_pack")
    exec(compile(code, f"msmodelslim-26.1.0/{PACK_PY}", "exec"), mod.__dict__)
    return mod


def _e2m1_values(codes: np.ndarray) -> np.ndarray:
    """Element values of E2M1 codes, written out here (bit 3 = sign; code 8 is -0.0)."""
    mag = E2M1[codes & 7]
    return np.where(codes & 8, -mag, mag).astype(np.float32)


def test_int4_packing_is_byte_identical_on_random_codes(ms):
    rng = np.random.default_rng(0)
    for N, K in ((2, 16), (64, 48), (130, 96)):
        q = rng.integers(-8, 8, size=(N, K), dtype=np.int8)
        theirs = ms.w4a8_pack_int4(torch.from_numpy(q)).numpy()
        ours = nm.pack_int4_along_n(q)
        assert theirs.dtype == np.int8 and ours.shape == theirs.shape == (N // 2, K)
        assert ours.view(np.uint8).tobytes() == theirs.view(np.uint8).tobytes()


@pytest.mark.parametrize("matmul,name", [("gate", "model.layers.1.block_sparse_moe.experts.3.w1"),
                                         ("up", "model.layers.1.block_sparse_moe.experts.3.w3"),
                                         ("down", "model.layers.1.block_sparse_moe.experts.3.w2")])
def test_w4a8_codec_output_matches_msmodelslim_packing_and_scale_bias(ms, matmul, name):
    rng = np.random.default_rng(1)
    N, K = 96, 256
    w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
    out = get_codec("W4A8_DYNAMIC").quantize(w, matmul)
    s = out["weight_scale"].reshape(N)
    # the codes, recovered from the dequantized weight (exact: q * s / s for |q| <= 8)
    q = np.rint(get_codec("W4A8_DYNAMIC").dequantize(out) / s[:, None]).astype(np.int8)
    assert np.abs(q).max() <= 8
    assert out["weight"].view(np.uint8).tobytes() == ms.w4a8_pack_int4(torch.from_numpy(q)).numpy().view(np.uint8).tobytes()
    # msModelSlim's ascendv1 saver: process_scale(prefix, (q * s) [N, K], tp_num=16); it classifies by name
    deq = torch.from_numpy(q.astype(np.float32) * s[:, None])
    theirs = ms.process_scale(name, deq, 16).numpy()
    assert theirs.shape == out["scale_bias"].shape == (N, 16 if matmul == "down" else 1)
    # same sums; theirs adds float32 products (rounded per step), ours is the exact sum rounded once
    np.testing.assert_allclose(out["scale_bias"], theirs, rtol=2e-6, atol=1e-6 * float(np.abs(theirs).max()))


def test_fp4_packing_is_byte_identical_on_random_codes(ms):
    rng = np.random.default_rng(2)
    for N, K in ((1, 64), (33, 128), (128, 256)):
        codes = rng.integers(0, 16, size=(N, K), dtype=np.uint8)
        theirs = ms.pack_fp4_to_uint8(torch.from_numpy(_e2m1_values(codes))).numpy()
        ours = nm.pack_nibbles_along_k(codes)
        assert theirs.dtype == np.uint8 and ours.shape == theirs.shape == (N, K // 2)
        assert ours.tobytes() == theirs.tobytes()


def test_mxfp4_codec_output_matches_msmodelslim_packing(ms):
    rng = np.random.default_rng(3)
    N, K = 64, 512
    w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block: codes must stay +0 (msModelSlim writes signbit(-0.0) as code 8)
    out = get_codec("W4A8_MXFP")
    res = out.quantize(w)
    codes = np.stack([res["weight"] & 0xF, res["weight"] >> 4], axis=-1).reshape(N, K)  # element 2i low nibble
    theirs = ms.pack_fp4_to_uint8(torch.from_numpy(_e2m1_values(codes))).numpy()
    assert res["weight"].tobytes() == theirs.tobytes()
    # and the element values times 2^(scale byte - 127) are what our dequantize returns
    scale = np.ldexp(1.0, res["weight_scale"].astype(np.int32) - 127).repeat(32, axis=1)
    np.testing.assert_array_equal(_e2m1_values(codes) * scale, out.dequantize(res))


@pytest.mark.parametrize("matmul,name", [("gate", "model.layers.1.mlp.experts.3.gate_proj"),
                                         ("down", "model.layers.1.mlp.experts.3.down_proj")])
@pytest.mark.parametrize("group", [32, 128])
def test_per_group_w4a8_matches_msmodelslim_packing_and_scale_bias(ms, matmul, name, group):
    """Per group (--group-size): the same packing, and scale_bias as msModelSlim's process_scale sums it
    from the dequantized weight. Ours uses the scale the kernel uses (float16(weight_scale *
    weight_scale_second), exact here); msModelSlim's llm_ptq saver multiplies the codes by both scales
    rounded to bfloat16 first, which agrees only to bfloat16 precision (checked too)."""
    rng = np.random.default_rng(group)
    N, K = 64, 512
    w = (rng.standard_normal((N, K)) * 0.02 * np.exp(rng.standard_normal((N, 1)))).astype(np.float32)
    codec = get_codec("W4A8_DYNAMIC", group)
    out = codec.quantize(w, matmul)
    q = nm.unpack_int4_along_n(out["weight"])
    theirs_bytes = ms.w4a8_pack_int4(torch.from_numpy(q)).numpy().view(np.uint8).tobytes()
    assert out["weight"].view(np.uint8).tobytes() == theirs_bytes
    s_eff = np.repeat(nm.int4_effective_scale(out["weight_scale"], out["weight_scale_second"]), group, axis=1)
    theirs = ms.process_scale(name, torch.from_numpy(q.astype(np.float32) * s_eff), 16).numpy()
    assert theirs.shape == out["scale_bias"].shape == (N, 16 if matmul == "down" else 1)
    np.testing.assert_allclose(out["scale_bias"], theirs, rtol=2e-6, atol=1e-6 * float(np.abs(theirs).max()))
    second = torch.from_numpy(out["weight_scale_second"]).to(torch.bfloat16).float().numpy()
    first = torch.from_numpy(out["weight_scale"]).to(torch.bfloat16).float().numpy()
    bf16_way = ms.process_scale(name, torch.from_numpy(q.astype(np.float32) * np.repeat(second, group, axis=1) * first),
                                16).numpy()
    np.testing.assert_allclose(out["scale_bias"], bf16_way, rtol=2**-8, atol=2**-8 * float(np.abs(theirs).max()))
