"""Integer schemes for Atlas A3: W4A8_DYNAMIC (int4, packed along N) and W8A8_DYNAMIC (int8)."""

from __future__ import annotations

import math

import numpy as np

from . import numerics as nm
from .base import REGISTRY, Codec, Grid, Spec, bf16_bits, load_kernels, raise_nonfinite_bf16, register


@register
class W4A8Dynamic(Codec):
    """int4 symmetric weights, int8 per-token dynamic activations; per output channel (the default)
    or per group of G inputs (``get_codec("W4A8_DYNAMIC", group_size=G)``, description "group_size": G).

    On disk: ``weight`` int8 [N/2, K] (nibbles packed along N: byte[j,k] = q[2j,k] & 0xF | q[2j+1,k] << 4),
    ``weight_scale`` / ``weight_offset`` float32 [N, 1], ``scale_bias`` float32 [N, 1] (gate/up) or
    [N, 16] (down: 16 partial sums over contiguous K/16 chunks) = 8 * sum_k q[n,k] * s[n,k].
    Per channel: s[n,k] = weight_scale[n], the smallest that clips nothing, max(max(w)/7, -min(w)/8) per
    row (``numerics.int4_scale``).  Per group: also ``weight_scale_second`` float32 [N, K/G] and
    ``weight_offset_second`` float32 [N, K/G] (zeros); the loader's scale is
    float16(weight_scale * weight_scale_second), so the group's rule is rounded up to float16 and
    written whole into ``weight_scale_second``, with ``weight_scale`` = 1.0 (``numerics.int4_group_scale``).
    Calibrated: GPTQ on the same grid (``gptq``).
    """

    name = "W4A8_DYNAMIC"
    rank = None  # never counts for model_quant_type
    activation = "int8"
    reads_group_size = True

    def __init__(self, group_size: int = 0):
        self.group_size = int(group_size)
        if self.group_size:
            self.dequant_inputs = ("weight", "weight_scale", "weight_scale_second")

    def with_group_size(self, group_size: int) -> "W4A8Dynamic":
        if not group_size:
            return REGISTRY[self.name]
        if group_size < 0:
            raise ValueError(f"{self.name}: group size must be positive, got {group_size}")
        if group_size not in _GROUPED:
            _GROUPED[group_size] = W4A8Dynamic(group_size)
        return _GROUPED[group_size]

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
        if self.group_size and K % self.group_size:
            return (f"--group-size {self.group_size} needs K divisible by it (got K={K}; the loader reshapes the "
                    f"scales into K / {self.group_size} groups)")
        return None

    def require(self, shape, matmul):
        # quantize() without a role (tests, tools) behaves like gate/up: scale_bias [N, 1]
        super().require(shape, matmul or "gate")

    def out_specs(self, shape, matmul) -> Spec:
        N, K = shape
        specs = {"weight": ("I8", (N // 2, K)), "weight_scale": ("F32", (N, 1)), "weight_offset": ("F32", (N, 1))}
        if self.group_size:
            specs["weight_scale_second"] = ("F32", (N, K // self.group_size))
            specs["weight_offset_second"] = ("F32", (N, K // self.group_size))
        specs["scale_bias"] = ("F32", (N, 16 if matmul == "down" else 1))
        return specs

    def data_free_codes(self, w, matmul):
        if self.group_size:
            q, s = nm.int4_group_quantize(w, self.group_size)
            return Grid(s, self.group_size, "int", -8, 7), q
        q, s = nm.int4_quantize(w)
        return Grid(s[:, None], w.shape[1], "int", -8, 7), q

    def encode(self, codes, grid, matmul):
        q = codes.astype(np.int8)
        N = q.shape[0]
        if not self.group_size:
            s = np.ascontiguousarray(grid.scale[:, 0], dtype=np.float32)
            return {"weight": nm.pack_int4_along_n(q), "weight_scale": s[:, None].copy(),
                    "weight_offset": np.zeros((N, 1), np.float32), "scale_bias": nm.int4_scale_bias(q, s, matmul)}
        s = np.ascontiguousarray(grid.scale, dtype=np.float32)
        return {"weight": nm.pack_int4_along_n(q), "weight_scale": np.ones((N, 1), np.float32),
                "weight_offset": np.zeros((N, 1), np.float32), "weight_scale_second": s.copy(),
                "weight_offset_second": np.zeros_like(s), "scale_bias": nm.int4_group_scale_bias(q, s, matmul)}

    def _quantize_bf16_fast(self, w_u16, matmul, out):
        w = bf16_bits(w_u16)
        res = self.alloc(w.shape, matmul, out)
        kernels = load_kernels()
        if self.group_size:
            chunks = res["scale_bias"].shape[1]
            seg = math.gcd(self.group_size, w.shape[1] // chunks)
            bad = kernels.int4_group_kernel(w, self.group_size, seg, res["weight"], res["weight_scale_second"],
                                            res["scale_bias"])
            res["weight_scale"].fill(1.0)
            res["weight_offset_second"].fill(0)
        else:
            bad = kernels.int4_kernel(w, res["weight"], res["weight_scale"], res["scale_bias"])
        if bad >= 0:
            raise_nonfinite_bf16(w, bad)
        res["weight_offset"].fill(0)
        return res

    def dequantize(self, tensors):
        """What the loader computes with: q * weight_scale (per channel), or q * float16(weight_scale *
        weight_scale_second) per group (its ``process_scale``)."""
        q = nm.unpack_int4_along_n(np.asarray(tensors["weight"]))
        first = np.asarray(tensors["weight_scale"], np.float32).reshape(-1, 1)
        if not self.group_size:
            return q.astype(np.float32) * first
        second = np.asarray(tensors["weight_scale_second"], np.float32)
        N, K = q.shape
        if second.shape != (N, K // self.group_size) or K % self.group_size:
            raise ValueError(f"{self.name} group size {self.group_size}: weight_scale_second is {list(second.shape)}, "
                             f"the weight [{N}, {K}] needs [{N}, {K // self.group_size}]")
        s = nm.int4_effective_scale(first, second)
        return q.astype(np.float32) * np.repeat(s, self.group_size, axis=1)


_GROUPED: dict[int, W4A8Dynamic] = {}


@register
class W8A8Dynamic(Codec):
    """int8 per-output-channel symmetric weights, int8 per-token dynamic activations.

    s = float32(amax / 127) (1.0 for an all-zero row), q = clip(rint(w / s), -127, 127) with
    round-half-to-even; ``weight_offset`` is zeros.

    ``get_codec("W8A8_DYNAMIC").with_pow2_scale()``: the same format with s the smallest power of two that
    clips nothing (``numerics.int8_pow2_scale``), for weights decoded from MXFP4: every row whose 32-blocks'
    exponents lie within 3 of its largest is then written exactly (the loaders read it unchanged).
    """

    name = "W8A8_DYNAMIC"
    rank = 1
    activation = "int8"

    def __init__(self, pow2_scale: bool = False):
        self.pow2_scale = bool(pow2_scale)

    def with_pow2_scale(self) -> "W8A8Dynamic":
        """This scheme with power-of-two row scales (same tensors, same loaders)."""
        global _W8A8_POW2
        if _W8A8_POW2 is None:
            _W8A8_POW2 = W8A8Dynamic(pow2_scale=True)
        return _W8A8_POW2

    def out_specs(self, shape, matmul) -> Spec:
        N, K = shape
        return {"weight": ("I8", (N, K)), "weight_scale": ("F32", (N, 1)), "weight_offset": ("F32", (N, 1))}

    def data_free_codes(self, w, matmul):
        q, s = nm.int8_pow2_quantize(w) if self.pow2_scale else nm.int8_quantize(w)
        return Grid(s[:, None], w.shape[1], "int", -127, 127), q

    def encode(self, codes, grid, matmul):
        return {"weight": codes.astype(np.int8), "weight_scale": np.asarray(grid.scale, np.float32).reshape(-1, 1).copy(),
                "weight_offset": np.zeros((codes.shape[0], 1), np.float32)}

    def _quantize_bf16_fast(self, w_u16, matmul, out):
        w = bf16_bits(w_u16)
        res = self.alloc(w.shape, matmul, out)
        kernels = load_kernels()
        kernel = kernels.int8_pow2_kernel if self.pow2_scale else kernels.int8_kernel
        bad = kernel(w, res["weight"], res["weight_scale"])
        if bad >= 0:
            raise_nonfinite_bf16(w, bad)
        res["weight_offset"].fill(0)
        return res

    def dequantize(self, tensors):
        q = np.asarray(tensors["weight"]).view(np.int8)
        return q.astype(np.float32) * np.asarray(tensors["weight_scale"], np.float32).reshape(-1, 1)


_W8A8_POW2: W8A8Dynamic | None = None
