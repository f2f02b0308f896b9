"""Golden bytes for the quantization codecs: nibble order, packing axis, E8M0/E4M3 bytes, scale_bias."""

import numpy as np
import pytest
import torch

from kimi_quant.dtypes import bf16_to_f32, f32_to_bf16
from kimi_quant.quant import get_codec
from kimi_quant.quant import numerics as nm


def both(name, w_f32, matmul=None):
    """Reference and fast path outputs (asserting they are bit-identical)."""
    codec = get_codec(name)
    w_u16 = f32_to_bf16(np.asarray(w_f32, np.float32))
    assert np.array_equal(bf16_to_f32(w_u16), np.asarray(w_f32, np.float32)), "golden inputs must be bf16-exact"
    ref = codec.quantize(bf16_to_f32(w_u16), matmul)
    fast = codec.quantize_bf16(w_u16, matmul)
    assert ref.keys() == fast.keys() == codec.out_specs(w_u16.shape, matmul).keys()
    for k in ref:
        assert ref[k].dtype == fast[k].dtype and ref[k].shape == fast[k].shape, k
        assert np.array_equal(ref[k].view(np.uint8), fast[k].view(np.uint8)), k
    return fast


# ---------------------------------------------------------------------------------------- int4


def test_int4_pack_along_n_golden():
    q = np.array([[-8, 7], [7, -1], [1, 2], [0, -3]], dtype=np.int8)
    b = nm.pack_int4_along_n(q)
    assert b.dtype == np.int8 and b.shape == (2, 2)
    assert b.view(np.uint8).tolist() == [[0x78, 0xF7], [0x01, 0xD2]]
    assert np.array_equal(nm.unpack_int4_along_n(b), q)


def test_int4_codec_golden_gate_and_down():
    # scale = max(max(w)/7, -min(w)/8): rows on the grid of that scale (row 1 and 3: the negative
    # side dominates and reaches code -8) are reproduced exactly
    q = np.array(
        [[7, -1, 3, 0] * 8, [-8, 2, 5, -6] * 8, [1, 7, 0, 0] * 8, [0, -8, -2, 4] * 8], dtype=np.int8
    )
    s = np.array([1.0, 0.5, 2.0**-10, 3.0], dtype=np.float32)
    w = q * s[:, None]
    out = both("W4A8_DYNAMIC", w, "gate")
    assert out["weight"].shape == (2, 32) and out["weight"].dtype == np.int8
    assert out["weight"].view(np.uint8)[0, :4].tolist() == [0x87, 0x2F, 0x53, 0xA0]
    assert np.array_equal(nm.unpack_int4_along_n(out["weight"]), q)
    assert out["weight_scale"].tolist() == [[1.0], [0.5], [2.0**-10], [3.0]]
    assert not out["weight_offset"].any() and out["weight_offset"].shape == (4, 1)
    assert out["scale_bias"].shape == (4, 1)
    # 8 * sum_k q * s: row sums 9*8, -7*8, 8*8, -6*8
    np.testing.assert_array_equal(out["scale_bias"][:, 0], np.float32([8 * 72 * 1.0, 8 * -56 * 0.5, 8 * 64 * 2.0**-10, 8 * -48 * 3.0]))

    down = both("W4A8_DYNAMIC", w, "down")
    assert down["scale_bias"].shape == (4, 16)
    # K = 32 -> 16 chunks of 2: chunk c holds q[2c], q[2c+1]
    expect = 8.0 * q.reshape(4, 16, 2).sum(axis=2) * s[:, None]
    np.testing.assert_array_equal(down["scale_bias"], expect.astype(np.float32))
    assert np.array_equal(down["weight"], out["weight"])


def test_int4_scale_rule_golden():
    # positive side dominates: s = 7/7 = 1 (as absmax); negative: s = 7/8, -7 -> code -8, 3 -> 3.43 -> 3;
    # ties round half to even: 2.5 -> 2, -1.5 -> -2 at s = 1
    w = np.zeros((4, 32), np.float32)
    w[0, :4] = [7, -7, 2.5, -1.5]
    w[1, :3] = [-7, 3, 6]
    w[2, :2] = [0.0, -0.0]
    w[3, :2] = [6, -0.75]  # s = 6/7 (float32 division)
    out = both("W4A8_DYNAMIC", w, "up")
    assert out["weight_scale"][:, 0].tolist() == [1.0, 0.875, 1.0, float(np.float32(6) / np.float32(7))]
    q = nm.unpack_int4_along_n(out["weight"])
    assert q[0, :4].tolist() == [7, -7, 2, -2]
    assert q[1, :3].tolist() == [-8, 3, 7]
    assert not q[2].any()
    assert q[3, :2].tolist() == [7, -1]


def test_int4_zero_rows():
    w = np.zeros((4, 32), np.float32)
    w[1, 3] = 0.25
    out = both("W4A8_DYNAMIC", w, "down")
    assert out["weight_scale"][[0, 2, 3], 0].tolist() == [1.0, 1.0, 1.0]
    assert np.isfinite(out["weight_scale"]).all() and (out["weight_scale"] > 0).all()
    q = nm.unpack_int4_along_n(out["weight"])
    assert not q[[0, 2, 3]].any() and not out["scale_bias"][[0, 2, 3]].any()


# ---------------------------------------------------------------------------------------- int8


def test_int8_golden_round_half_even():
    row = np.zeros(32, np.float32)
    row[:7] = [127, -127, 63.5, 0.5, 1.5, 2.5, -2.5]
    w = np.stack([row, np.zeros(32, np.float32)])
    out = both("W8A8_DYNAMIC", w)
    assert out["weight"][0, :7].tolist() == [127, -127, 64, 0, 2, 2, -2]
    assert out["weight_scale"].tolist() == [[1.0], [1.0]]
    assert not out["weight"][1].any()
    assert out["weight_offset"].shape == (2, 1) and not out["weight_offset"].any()


# ---------------------------------------------------------------------------------------- MXFP4


def test_mxfp4_golden_bytes():
    b0 = np.zeros(32, np.float32)
    b0[:18] = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.1015625]
    b1 = b0 * np.float32(2.0**-10)  # same codes, scale 2^-10
    b2 = np.zeros(32, np.float32)  # all-zero block
    b3 = np.zeros(32, np.float32)
    b3[0] = 7.0  # e0: 7 -> 6 (err 1); e1: 3.5 -> 4 i.e. 8 (err 1): tie keeps the OCP exponent
    b4 = np.zeros(32, np.float32)
    b4[0] = 7.5  # e0: err 1.5; e1: 3.75 -> 4 i.e. 8 (err 0.5): e1 wins
    b4[1] = -1.0  # under e1: 0.5 -> code 1 | sign
    w = np.concatenate([b0, b1, b2, b3, b4])[None, :].repeat(2, axis=0)
    out = both("W4A8_MXFP", w)
    assert out["weight"].shape == (2, 80) and out["weight"].dtype == np.uint8
    assert out["weight_scale"].shape == (2, 5) and out["weight_scale"].dtype == np.uint8
    # codes 0,1,2,3,4,5,6,7, 9,15, 0,2,2,4,4,6,6, 0 (tiny negative -> +0); element 2i in the low nibble
    golden = [0x10, 0x32, 0x54, 0x76, 0xF9, 0x20, 0x42, 0x64, 0x06] + [0] * 7
    assert out["weight"][0, :16].tolist() == golden
    assert out["weight"][0, 16:32].tolist() == golden
    assert not out["weight"][0, 32:48].any()
    assert out["weight"][0, 48] == 0x07
    assert out["weight"][0, 64] == 0x96  # 7.5 -> code 6 (4 * 2), -1 -> code 9 (-0.5 * 2)
    assert out["weight_scale"][0].tolist() == [127, 117, nm.E8M0_ZERO_BLOCK, 127, 128]
    deq = get_codec("W4A8_MXFP").dequantize(out)
    assert deq[0, :10].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -6]
    assert deq[0, 128:130].tolist() == [8.0, -1.0]


def test_e8m0_bytes_ocp_rule():
    # amax = 1 -> floor(log2) = 0 -> e = -2 -> byte 125 (no element saturates, so the OCP rule stays)
    for amax, byte in [(1.0, 125), (1.5, 125), (4.0, 127), (2.0**-20, 105), (2.0**100, 225)]:
        w = np.zeros((1, 32), np.float32)
        w[0, 5] = amax
        assert both("W4A8_MXFP", w)["weight_scale"][0, 0] == byte, amax
    # bf16 subnormals clamp the exponent at -127 (byte 0)
    w = np.zeros((1, 32), np.float32)
    w[0, 0] = bf16_to_f32(np.array([0x0001], np.uint16))[0]
    assert both("W4A8_MXFP", w)["weight_scale"][0, 0] == 0


# ---------------------------------------------------------------------------------------- MXFP8


def test_e4m3_round_matches_torch_in_range():
    rng = np.random.default_rng(0)
    vals = np.concatenate(
        [
            rng.uniform(0, 448, 4000),
            np.exp2(rng.uniform(-14, 8.8, 4000)),
            np.arange(0, 64) * 2.0**-10,  # subnormal ties
            [0.0, 2.0**-9, 2.0**-6, 448.0, 440.0, 447.99, 0.013671875, 300.0],
        ]
    ).astype(np.float32)
    vals = np.minimum(vals, np.float32(448.0))
    byte, value = nm.e4m3_round(vals)
    t = torch.from_numpy(vals).to(torch.float8_e4m3fn)
    assert np.array_equal(byte, t.view(torch.uint8).numpy())
    assert np.array_equal(value, t.to(torch.float32).numpy())
    assert np.array_equal(nm.e4m3_to_f32(byte), value)


def test_mxfp8_golden_bytes():
    b0 = np.zeros(32, np.float32)
    b0[:8] = [256, 1, 0.5, -3, 2.0**-9, 0.013671875, 300, -0.0009765625]
    b1 = np.zeros(32, np.float32)
    b1[0] = 480.0  # 480 > 448: e0 saturates (err 32); e1: 240 exact -> e1 wins
    w = np.concatenate([b0, b1])[None, :]
    out = both("W8A8_MXFP8", w)
    assert out["weight"].dtype == np.uint8 and out["weight"].shape == (1, 64)
    expect = torch.tensor([256, 1, 0.5, -3, 2.0**-9, 0.013671875, 288, -0.0]).to(torch.float8_e4m3fn).view(torch.uint8)
    assert out["weight"][0, :8].tolist() == [x if x != 0x80 else 0 for x in expect.tolist()]  # -0.0009765 -> +0
    assert out["weight_scale"][0].tolist() == [127, 128]
    assert out["weight"][0, 32] == torch.tensor([240.0]).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert get_codec("W8A8_MXFP8").dequantize(out)[0, 32] == 480.0


# ---------------------------------------------------------------------------------------- contracts

SCHEMES = [("W4A8_DYNAMIC", "gate"), ("W4A8_DYNAMIC", "down"), ("W8A8_DYNAMIC", None), ("W4A8_MXFP", None), ("W8A8_MXFP8", None)]


@pytest.mark.parametrize("name,matmul", SCHEMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_raises_value_error(name, matmul, bad):
    w = np.ones((4, 64), np.float32)
    w[2, 37] = bad
    codec = get_codec(name)
    with pytest.raises(ValueError, match="row 2, column 37"):
        codec.quantize(w, matmul)
    with pytest.raises(nm.NonFiniteWeight, match="row 2, column 37"):
        codec.quantize_bf16(f32_to_bf16(w), matmul)


@pytest.mark.parametrize("name,matmul", SCHEMES)
def test_out_arrays_are_filled_in_place(name, matmul):
    codec = get_codec(name)
    w = f32_to_bf16(np.random.default_rng(1).standard_normal((6, 64)).astype(np.float32))
    out = codec.alloc(w.shape, matmul)
    got = codec.quantize_bf16(w, matmul, out=out)
    assert all(got[k] is out[k] for k in out)
    fresh = codec.quantize_bf16(w, matmul)
    assert all(np.array_equal(fresh[k], got[k]) for k in fresh)
    key = next(iter(out))
    with pytest.raises(ValueError, match="C-contiguous"):
        codec.quantize_bf16(w, matmul, out={key: np.empty((1, 1), np.float64)})


def test_dequantize_prefixed():
    from kimi_quant.quant.base import dequantize_prefixed

    codec = get_codec("W4A8_DYNAMIC")
    w = f32_to_bf16(np.random.default_rng(2).standard_normal((4, 32)).astype(np.float32))
    out = codec.quantize_bf16(w, "up")
    named = {f"m.up_proj.{k}": v for k, v in out.items()}
    np.testing.assert_array_equal(dequantize_prefixed("W4A8_DYNAMIC", named, "m.up_proj"), codec.dequantize(out))
