"""Quantization codecs, one class per ascendV1 type string (see base.Codec)."""

from .base import REGISTRY, Codec, get_codec, register
from . import int_schemes, mx_schemes  # noqa: F401  (register the codecs)

__all__ = ["REGISTRY", "Codec", "get_codec", "register"]
