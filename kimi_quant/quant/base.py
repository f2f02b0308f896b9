"""The codec interface: one small class per quantization scheme, registered by its type string.

A codec knows three things about scheme X applied to a Linear weight ``[N, K]`` (N = out, K = in):
  * ``out_specs(shape, matmul)``: the ascendV1 tensors it writes, ``{suffix: (dtype, shape)}``,
    so a plan can size every output without reading any data;
  * ``quantize(w, matmul)``: float32 ``[N, K]`` -> ``{suffix: ndarray}`` (the plain numpy reference);
  * ``dequantize(tensors)``: the inverse, public so validation can read back output bytes.
``quantize_bf16(w_u16, matmul)`` is the fast path from raw bfloat16 bits; it must be
bit-identical to ``quantize(bf16_to_f32(w_u16), matmul)``.

``matmul`` is the role of the Linear in an MLP (``"gate"``, ``"up"``, ``"down"`` or None), decided
by the model spec; only W4A8_DYNAMIC uses it (``scale_bias`` shape).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..dtypes import bf16_to_f32

Spec = dict[str, tuple[str, tuple[int, ...]]]


class Codec:
    name: ClassVar[str]
    #: rank in model_quant_type ordering (highest present wins); None never counts
    rank: ClassVar[int | None] = None

    def check(self, shape: tuple[int, ...], matmul: str | None) -> str | None:
        """Why this scheme cannot apply to a tensor of ``shape`` (None when it can)."""
        if len(shape) != 2:
            return f"{self.name} needs a 2-D Linear weight, got shape {list(shape)}"
        return None

    def out_specs(self, shape: tuple[int, ...], matmul: str | None) -> Spec:
        raise NotImplementedError

    def quantize(self, w: np.ndarray, matmul: str | None = None) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def quantize_bf16(self, w_u16: np.ndarray, matmul: str | None = None) -> dict[str, np.ndarray]:
        return self.quantize(bf16_to_f32(w_u16), matmul)

    def dequantize(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError


REGISTRY: dict[str, Codec] = {}


def register(cls: type[Codec]) -> type[Codec]:
    REGISTRY[cls.name] = cls()
    return cls


def get_codec(name: str) -> Codec:
    from ..errors import RecipeError

    try:
        return REGISTRY[name]
    except KeyError:
        raise RecipeError(f"unknown scheme {name!r}; known: {', '.join(sorted(REGISTRY))}") from None
