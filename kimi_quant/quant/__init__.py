"""Quantization codecs, one class per ascendV1 type string (see base.Codec)."""

from .base import REGISTRY, Codec, dequantize_prefixed, get_codec, load_kernels, register
from . import int_schemes, mx_schemes  # noqa: F401  (register the codecs)
from .mx_schemes import decode_mxfp4, decode_mxfp4_bf16
from .numerics import NonFiniteWeight


def warmup(writable: bool = True) -> None:
    """Compile (or load from numba's cache) every kernel; see ``kernels.warmup``."""
    load_kernels().warmup(writable)

__all__ = ["REGISTRY", "Codec", "NonFiniteWeight", "decode_mxfp4", "decode_mxfp4_bf16", "dequantize_prefixed", "get_codec", "register",
           "warmup"]
