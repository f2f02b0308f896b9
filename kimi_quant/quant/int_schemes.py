"""Integer schemes for Atlas A3: W4A8_DYNAMIC (int4, packed along N) and W8A8_DYNAMIC (int8)."""

from __future__ import annotations

import numpy as np

from . import numerics as nm
from .base import Codec, Spec, load_kernels, register
from .gptq import Grid


def _u16(w_u16: np.ndarray) -> np.ndarray:
    w = np.ascontiguousarray(w_u16)
    if w.dtype != np.uint16 or w.ndim != 2:
        raise TypeError(f"quantize_bf16 needs a 2-D uint16 array of bf16 bits, got {w.dtype} {list(w.shape)}")
    return w


def _raise_nonfinite(w_u16: np.ndarray, row: int) -> None:
    col = int(np.argmax((w_u16[row] & 0x7F80) == 0x7F80))
    raise nm.NonFiniteWeight(row, col)


@register
class W4A8Dynamic(Codec):
    """int4 per-output-channel symmetric weights, int8 per-token dynamic activations.

    On disk: ``weight`` int8 [N/2, K] (nibbles packed along N: byte[j,k] = q[2j,k] & 0xF | q[2j+1,k] << 4),
    ``weight_scale`` / ``weight_offset`` float32 [N, 1], ``scale_bias`` float32 [N, 1] (gate/up) or
    [N, 16] (down: 16 partial sums over contiguous K/16 chunks) = 8 * sum_k q[n,k] * s[n].
    Scale (data-free): the smallest that clips nothing, max(max(w)/7, -min(w)/8) per row
    (``numerics.int4_scale``); with a hessian, GPTQ on that grid (``gptq``).
    """

    name = "W4A8_DYNAMIC"
    rank = None  # never counts for model_quant_type

    def check(self, shape, matmul):
        why = super().check(shape, matmul)
        if why:
            return why
        N, K = shape
        if matmul not in ("gate", "up", "down"):
            return f"{self.name} is only for MLP/expert gate, up and down projections (scale_bias needs the role)"
        if N % 2:
            return f"{self.name} packs int4 pairs along N, so N must be even (got N={N})"
        if K > nm.INT4_MAX_K:
            return f"{self.name} supports K <= {nm.INT4_MAX_K} (got K={K})"
        if matmul == "down" and K % 16:
            return f"{self.name} down projection needs K divisible by 16 for scale_bias (got K={K})"
        return None

    def require(self, shape, matmul):
        # quantize() without a role (tests, tools) behaves like gate/up: scale_bias [N, 1]
        super().require(shape, matmul or "gate")

    def out_specs(self, shape, matmul) -> Spec:
        N, K = shape
        return {
            "weight": ("I8", (N // 2, K)),
            "weight_scale": ("F32", (N, 1)),
            "weight_offset": ("F32", (N, 1)),
            "scale_bias": ("F32", (N, 16 if matmul == "down" else 1)),
        }

    def data_free_codes(self, w, matmul):
        q, s = nm.int4_quantize(w)
        return Grid(s[:, None], w.shape[1], "int", -8, 7), q

    def encode(self, codes, grid, matmul):
        q = codes.astype(np.int8)
        s = np.ascontiguousarray(grid.scale[:, 0], dtype=np.float32)
        return {
            "weight": nm.pack_int4_along_n(q),
            "weight_scale": s[:, None].copy(),
            "weight_offset": np.zeros((q.shape[0], 1), np.float32),
            "scale_bias": nm.int4_scale_bias(q, s, matmul),
        }

    def _quantize_bf16_fast(self, w_u16, matmul, out):
        w = _u16(w_u16)
        res = self.alloc(w.shape, matmul, out)
        bad = load_kernels().int4_kernel(
            w, res["weight"], res["weight_scale"], res["scale_bias"]
        )
        if bad >= 0:
            _raise_nonfinite(w, bad)
        res["weight_offset"].fill(0)
        return res

    def dequantize(self, tensors):
        q = nm.unpack_int4_along_n(np.asarray(tensors["weight"]))
        return q.astype(np.float32) * np.asarray(tensors["weight_scale"], np.float32).reshape(-1, 1)


@register
class W8A8Dynamic(Codec):
    """int8 per-output-channel symmetric weights, int8 per-token dynamic activations.

    s = float32(amax / 127) (1.0 for an all-zero row), q = clip(rint(w / s), -127, 127) with
    round-half-to-even; ``weight_offset`` is zeros.
    """

    name = "W8A8_DYNAMIC"
    rank = 1

    def out_specs(self, shape, matmul) -> Spec:
        N, K = shape
        return {"weight": ("I8", (N, K)), "weight_scale": ("F32", (N, 1)), "weight_offset": ("F32", (N, 1))}

    def data_free_codes(self, w, matmul):
        q, s = nm.int8_quantize(w)
        return Grid(s[:, None], w.shape[1], "int", -127, 127), q

    def encode(self, codes, grid, matmul):
        return {"weight": codes.astype(np.int8), "weight_scale": np.asarray(grid.scale, np.float32).reshape(-1, 1).copy(),
                "weight_offset": np.zeros((codes.shape[0], 1), np.float32)}

    def _quantize_bf16_fast(self, w_u16, matmul, out):
        w = _u16(w_u16)
        res = self.alloc(w.shape, matmul, out)
        bad = load_kernels().int8_kernel(w, res["weight"], res["weight_scale"])
        if bad >= 0:
            _raise_nonfinite(w, bad)
        res["weight_offset"].fill(0)
        return res

    def dequantize(self, tensors):
        q = np.asarray(tensors["weight"]).view(np.int8)
        return q.astype(np.float32) * np.asarray(tensors["weight_scale"], np.float32).reshape(-1, 1)
