"""OCP Microscaling schemes for Ascend 950DT: W4A8_MXFP (E2M1) and W8A8_MXFP8 (E4M3), E8M0 scales per 32 along K."""

from __future__ import annotations

import numpy as np

from ..dtypes import bf16_to_f32, f32_to_bf16
from . import numerics as nm
from .base import Codec, Grid, Spec, bf16_bits, load_kernels, raise_nonfinite_bf16, register
from .numerics import BLOCK


class _MX(Codec):
    """Shared by both MX schemes: codes + E8M0 scales per 32 along K; subclasses name the element type."""

    elem: str  # numerics.MX_ELEMENTS key
    e8m0_outputs = ("weight_scale",)
    activation = "mxfp8"

    @staticmethod
    def _pack(code: np.ndarray) -> np.ndarray:
        return code

    @staticmethod
    def _values(weight: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    @staticmethod
    def _codes(weight: np.ndarray) -> np.ndarray:
        """The sign-magnitude codes [N, K] in ``weight`` as written (the inverse of ``_pack``)."""
        return weight

    kernel: str  # name of the numba kernel in ``kernels``: (w, weight_out, scale_out) -> bad row or -1

    def data_free_codes(self, w, matmul):
        code, scale = nm.mx_quantize(w, self.elem)
        return Grid(nm.e8m0_to_f32(scale), BLOCK, self.elem, scale_bytes=scale), code

    def fast_data_free_codes(self, w, matmul):
        bits = f32_to_bf16(w)
        if not np.array_equal(bf16_to_f32(bits), w):
            return self.data_free_codes(w, matmul)
        res = self._quantize_bf16_fast(bits, matmul, None)
        scale = res["weight_scale"]
        return Grid(nm.e8m0_to_f32(scale), BLOCK, self.elem, scale_bytes=scale), self._codes(res["weight"])

    def encode(self, codes, grid, matmul):
        return {"weight": self._pack(codes.astype(np.uint8)), "weight_scale": np.ascontiguousarray(grid.scale_bytes)}

    def _quantize_bf16_fast(self, w_u16, matmul, out):
        w = bf16_bits(w_u16)
        res = self.alloc(w.shape, matmul, out)
        bad = getattr(load_kernels(), self.kernel)(w, res["weight"], res["weight_scale"])
        if bad >= 0:
            raise_nonfinite_bf16(w, bad)
        return res

    def dequantize(self, tensors):
        values = self._values(np.asarray(tensors["weight"]).view(np.uint8))
        return nm.mx_dequantize(values, np.asarray(tensors["weight_scale"]).view(np.uint8))

    def check(self, shape, matmul):
        why = super().check(shape, matmul)
        if why:
            return why
        if shape[1] % BLOCK:
            return f"{self.name} needs K divisible by {BLOCK} (got K={shape[1]})"
        return None


@register
class W4A8MXFP(_MX):
    """MXFP4 weights: ``weight`` uint8 [N, K/2] (E2M1, element 2i in the low nibble), ``weight_scale`` uint8 [N, K/32] (E8M0).

    Per block of 32 the exponent is the OCP rule floor(log2(amax)) - 2 or one more, whichever has the
    smaller block squared error (ties: the OCP rule); all-zero blocks get scale byte 127.  Zero codes
    are always +0 (code 0, never 8).  See ``numerics.mx_quantize_blocks``.
    """

    name = "W4A8_MXFP"
    rank = 4

    def out_specs(self, shape, matmul) -> Spec:
        N, K = shape
        return {"weight": ("U8", (N, K // 2)), "weight_scale": ("U8", (N, K // BLOCK))}

    elem = "e2m1"
    _pack = staticmethod(nm.pack_nibbles_along_k)
    _codes = staticmethod(nm.unpack_nibbles_along_k)
    kernel = "mxfp4_kernel"
    # compressed-tensors' mxfp4-pack-quantized stores the same E2M1 nibbles in the same order and the
    # same E8M0 bytes: its experts are this scheme's output byte for byte
    takes_mxfp4 = True

    def from_mxfp4(self, codes, scales):
        return {"weight": codes, "weight_scale": scales}

    @staticmethod
    def _values(weight):
        return nm.e2m1_to_f32(nm.unpack_nibbles_along_k(weight))


@register
class W8A8MXFP8(_MX):
    """MXFP8 weights: ``weight`` float8_e4m3fn [N, K] (stored as uint8 bit patterns), ``weight_scale`` uint8 [N, K/32] (E8M0).

    Exponent: OCP rule floor(log2(amax)) - 8, or one more when that has the smaller block squared
    error (it avoids saturating at 448); elements round half to even and saturate at +-448.
    """

    name = "W8A8_MXFP8"
    rank = 3

    def out_specs(self, shape, matmul) -> Spec:
        N, K = shape
        return {"weight": ("F8_E4M3", (N, K)), "weight_scale": ("U8", (N, K // BLOCK))}

    elem = "e4m3"
    kernel = "mxfp8_kernel"
    _values = staticmethod(nm.e4m3_to_f32)  # weight holds F8_E4M3 bit patterns


def decode_mxfp4(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The exact float32 values of MXFP4 codes (U8 [N, K/2]) and E8M0 scales (U8 [N, K/32]), as a
    packed source tensor stores them: W4A8_MXFP's own decoding of the same bytes."""
    return np.asarray(W4A8MXFP().dequantize({"weight": codes, "weight_scale": scales}), dtype=np.float32)


#: scale bytes for which every E2M1 value times 2^(byte-127) is a normal bf16 (0.5 = 2^-1 ... 6 < 2^3)
_NORMAL_SCALES = (2, 252)


def decode_mxfp4_bf16(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``decode_mxfp4`` as bf16 bit patterns (uint16 [N, K]), which hold every MXFP4 value exactly
    (1-bit mantissas): the codes' bf16 bits with the block's exponent added (``mxfp4_decode_kernel``).
    Scales whose products would leave bf16's normal range take the exact float path."""
    if scales.size and (int(scales.min()) < _NORMAL_SCALES[0] or int(scales.max()) > _NORMAL_SCALES[1]):
        return f32_to_bf16(decode_mxfp4(codes, scales))
    out = np.empty((codes.shape[0], 2 * codes.shape[1]), dtype=np.uint16)
    load_kernels().mxfp4_decode_kernel(np.ascontiguousarray(codes), np.ascontiguousarray(scales), out)
    return out
