"""OCP Microscaling schemes for Ascend 950DT: W4A8_MXFP (E2M1) and W8A8_MXFP8 (E4M3), E8M0 scales per 32 along K."""

from __future__ import annotations

from .base import Codec, Spec, register

BLOCK = 32


class _MX(Codec):
    def check(self, shape, matmul):
        why = super().check(shape, matmul)
        if why:
            return why
        if shape[1] % BLOCK:
            return f"{self.name} needs K divisible by {BLOCK} (got K={shape[1]})"
        return None


@register
class W4A8MXFP(_MX):
    """MXFP4 weights: ``weight`` uint8 [N, K/2] (E2M1, element 2i in the low nibble), ``weight_scale`` uint8 [N, K/32] (E8M0)."""

    name = "W4A8_MXFP"
    rank = 4

    def out_specs(self, shape, matmul) -> Spec:
        N, K = shape
        return {"weight": ("U8", (N, K // 2)), "weight_scale": ("U8", (N, K // BLOCK))}


@register
class W8A8MXFP8(_MX):
    """MXFP8 weights: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` uint8 [N, K/32] (E8M0)."""

    name = "W8A8_MXFP8"
    rank = 3

    def out_specs(self, shape, matmul) -> Spec:
        N, K = shape
        return {"weight": ("F8_E4M3", (N, K)), "weight_scale": ("U8", (N, K // BLOCK))}
