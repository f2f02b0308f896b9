"""Quantization codecs, one class per ascendV1 type string (see base.Codec)."""

from .base import REGISTRY, Codec, dequantize_prefixed, get_codec, register
from . import int_schemes, mx_schemes  # noqa: F401  (register the codecs)
from .kernels import warmup
from .numerics import NonFiniteWeight

__all__ = ["REGISTRY", "Codec", "NonFiniteWeight", "dequantize_prefixed", "get_codec", "register", "warmup"]
