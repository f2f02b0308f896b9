"""Integer schemes for Atlas A3: W4A8_DYNAMIC (int4, packed along N) and W8A8_DYNAMIC (int8)."""

from __future__ import annotations

import numpy as np

from .base import Codec, Spec, register


@register
class W4A8Dynamic(Codec):
    """int4 per-output-channel symmetric weights, int8 per-token dynamic activations.

    On disk: ``weight`` int8 [N/2, K] (nibbles packed along N: byte[j,k] = q[2j,k] & 0xF | q[2j+1,k] << 4),
    ``weight_scale`` / ``weight_offset`` float32 [N, 1], ``scale_bias`` float32 [N, 1] (gate/up) or
    [N, 16] (down: 16 partial sums over contiguous K/16 chunks) = 8 * sum_k q[n,k] * s[n].
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
        if matmul == "down" and K % 16:
            return f"{self.name} down projection needs K divisible by 16 for scale_bias (got K={K})"
        return None

    def out_specs(self, shape, matmul) -> Spec:
        N, K = shape
        return {
            "weight": ("I8", (N // 2, K)),
            "weight_scale": ("F32", (N, 1)),
            "weight_offset": ("F32", (N, 1)),
            "scale_bias": ("F32", (N, 16 if matmul == "down" else 1)),
        }


@register
class W8A8Dynamic(Codec):
    """int8 per-output-channel symmetric weights (codes in [-127, 127]), int8 per-token dynamic activations."""

    name = "W8A8_DYNAMIC"
    rank = 1

    def out_specs(self, shape, matmul) -> Spec:
        N, K = shape
        return {"weight": ("I8", (N, K)), "weight_scale": ("F32", (N, 1)), "weight_offset": ("F32", (N, 1))}
