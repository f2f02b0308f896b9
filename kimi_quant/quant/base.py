"""The codec interface: one small class per quantization scheme, registered by its type string.

A codec knows three things about scheme X applied to a Linear weight ``[N, K]`` (N = out, K = in):
  * ``out_specs(shape, matmul)``: the ascendV1 tensors it writes, ``{suffix: (dtype, shape)}``,
    so a plan can size every output without reading any data;
  * ``quantize(w, matmul)``: float32 ``[N, K]`` -> ``{suffix: ndarray}`` (the plain numpy reference
    of the data-free rule); the calibrated path (GPTQ error feedback on the same grid, same bytes
    format) is ``gptq.gptq_quantize(codec, w, matmul, hessian, cfg)``: gptq uses codecs, never the reverse;
  * ``dequantize(tensors)``: the inverse, public so validation can read back output bytes.
``quantize_bf16(w_u16, matmul)`` is the fast path from raw bfloat16 bits; it must be
bit-identical to ``quantize(bf16_to_f32(w_u16), matmul)``.

A subclass supplies ``data_free_codes`` (the reference rule as codes on a ``Grid``), ``encode``
(codes -> on-disk tensors), ``gptq_grids`` (the grids the calibrated path may use) and the numba
fast path ``_quantize_bf16_fast``.

``matmul`` is the role of the Linear in an MLP (``"gate"``, ``"up"``, ``"down"`` or None), decided
by the model spec; only W4A8_DYNAMIC uses it (``scale_bias`` shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..dtypes import bf16_to_f32
from ..errors import RecipeError
from .numerics import NonFiniteWeight


_kernels = None


def load_kernels():
    """The conversion kernels, loaded on first use (planning, verifying and the driver never need
    them): compiled ahead of time when this machine can build them (``aot``: no numba in the
    process), else numba's JIT kernels (``kernels``: its import and set-up cost ~0.7 s)."""
    global _kernels
    if _kernels is None:
        from . import aot

        _kernels = aot.load()
        if _kernels is None:
            from . import kernels

            _kernels = kernels
    return _kernels

Spec = dict[str, tuple[str, tuple[int, ...]]]


@dataclass
class Grid:
    """The fixed quantization grid of one matrix [N, K]: what a codec's codes are rounded on.

    scale: float32 [N, K // group] (int schemes: group = K, one scale per row; MX: group = 32, the
           E8M0 block scale 2^e as float32).
    kind:  "int" (codes clip(rint(w / s), qmin, qmax)), "e2m1" or "e4m3" (sign-magnitude MX codes).
    """

    scale: np.ndarray
    group: int
    kind: str
    qmin: int = 0
    qmax: int = 0
    scale_bytes: np.ndarray | None = None  # MX: the E8M0 bytes written for ``scale``


def bf16_bits(w_u16: np.ndarray) -> np.ndarray:
    """``w_u16`` as the C-contiguous 2-D uint16 array the fast kernels take (TypeError otherwise)."""
    w = np.ascontiguousarray(w_u16)
    if w.dtype != np.uint16 or w.ndim != 2:
        raise TypeError(f"quantize_bf16 needs a 2-D uint16 array of bf16 bits, got {w.dtype} {list(w.shape)}")
    return w


def raise_nonfinite_bf16(w_u16: np.ndarray, row: int) -> None:
    """Raise NonFiniteWeight for the first NaN/Inf of bf16 row ``row`` (a kernel reported that row)."""
    col = int(np.argmax((w_u16[row] & 0x7F80) == 0x7F80))
    raise NonFiniteWeight(row, col)


class Codec:
    name: ClassVar[str]
    #: rank in model_quant_type ordering (highest present wins); None never counts
    rank: ClassVar[int | None] = None
    #: how the device quantizes this Linear's input: "int8" (per token, dynamic) or "mxfp8" (E4M3 in
    #: blocks of 32 with E8M0 scales); validation and calibration simulate it
    activation: ClassVar[str]
    #: outputs stored as U8 that hold E8M0 scales (0xFF is their NaN: never written)
    e8m0_outputs: ClassVar[tuple[str, ...]] = ()
    #: the suffixes ``dequantize`` reads
    dequant_inputs: tuple[str, ...] = ("weight", "weight_scale")
    #: whether the loader reads the description's ``group_size`` for this type (only W4A8_DYNAMIC: the
    #: W8A8_DYNAMIC methods never look at it, MX blocks are 32 whatever it says)
    reads_group_size: ClassVar[bool] = False
    #: whether the codes and E8M0 scales of a packed MXFP4 source tensor are this scheme's output as
    #: they are (``from_mxfp4``): a repack, no requantization
    takes_mxfp4: ClassVar[bool] = False

    def from_mxfp4(self, codes: np.ndarray, scales: np.ndarray) -> dict[str, np.ndarray]:
        """A packed MXFP4 source tensor (codes U8 [N, K/2], scales U8 [N, K/32]) as this scheme's tensors."""
        raise NotImplementedError(f"{self.name} does not take MXFP4 codes as they are")

    def with_group_size(self, group_size: int) -> "Codec":
        """This scheme as the loader reads it under description ``"group_size": group_size``."""
        return self

    def check(self, shape: tuple[int, ...], matmul: str | None) -> str | None:
        """Why this scheme cannot apply to a tensor of ``shape`` (None when it can)."""
        if len(shape) != 2:
            return f"{self.name} needs a 2-D Linear weight, got shape {list(shape)}"
        return None

    def out_specs(self, shape: tuple[int, ...], matmul: str | None) -> Spec:
        raise NotImplementedError

    def quantize(self, w: np.ndarray, matmul: str | None = None) -> dict[str, np.ndarray]:
        """float32 ``w`` [N, K] -> the on-disk tensors ``{suffix: ndarray}`` by the data-free rule
        (the plain numpy reference the kernels match)."""
        w = np.ascontiguousarray(w, dtype=np.float32)
        self.require(w.shape, matmul)
        grid, codes = self.data_free_codes(w, matmul)
        return self.encode(codes, grid, matmul)

    def data_free_codes(self, w: np.ndarray, matmul: str | None):
        """The data-free rule as (Grid, codes [N, K]) (w float32, already checked)."""
        raise NotImplementedError

    def fast_data_free_codes(self, w: np.ndarray, matmul: str | None):
        """``data_free_codes``, the same codes and grid, by the fast kernel where it has one and ``w``
        holds bfloat16 values (the calibrated path's guard; the reference stays the numpy rule)."""
        return self.data_free_codes(w, matmul)

    def gptq_grids(self, w: np.ndarray, matmul: str | None, data_free: tuple) -> list:
        """Candidate grids for the calibrated path; ``data_free`` is ``data_free_codes(w, matmul)``
        (default: its grid, the data-free rule's scales)."""
        return [data_free[0]]

    def encode(self, codes: np.ndarray, grid, matmul: str | None) -> dict[str, np.ndarray]:
        """Codes on ``grid`` -> the on-disk tensors (the format of ``out_specs``)."""
        raise NotImplementedError

    def quantize_bf16(
        self, w_u16: np.ndarray, matmul: str | None = None, out: dict[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Fast path from bf16 bits.  ``out`` (optional): preallocated arrays for some or all
        suffixes (C-contiguous, dtype/shape as ``out_specs``); they are filled and returned."""
        return self._quantize_bf16_fast(w_u16, matmul, out)

    def _quantize_bf16_fast(self, w_u16, matmul, out):
        return self.fill(self.quantize(bf16_to_f32(w_u16), matmul), w_u16.shape, matmul, out)

    def fill(self, res: dict[str, np.ndarray], shape, matmul: str | None, out: dict[str, np.ndarray] | None):
        """``res`` with the arrays of ``out`` (checked as ``alloc``) holding its values where given."""
        if out:
            for key, arr in self.alloc(shape, matmul, out).items():
                arr[...] = res[key]
                res[key] = arr
        return res

    def require(self, shape: tuple[int, ...], matmul: str | None) -> None:
        """Raise ValueError when ``check`` refuses the shape/role."""
        why = self.check(tuple(shape), matmul)
        if why:
            raise ValueError(why)

    def alloc(self, shape: tuple[int, ...], matmul: str | None, out: dict[str, np.ndarray] | None = None):
        """Output arrays per ``out_specs``: those given in ``out`` (checked) and fresh ones for the rest."""
        from ..dtypes import STORAGE

        self.require(tuple(shape), matmul)
        res = {}
        for key, (dtype, shp) in self.out_specs(tuple(shape), matmul).items():
            arr = (out or {}).get(key)
            if arr is None:
                arr = np.empty(shp, dtype=STORAGE[dtype])
            elif arr.dtype != STORAGE[dtype] or tuple(arr.shape) != tuple(shp) or not arr.flags.c_contiguous:
                raise ValueError(
                    f"{self.name}: out[{key!r}] must be C-contiguous {STORAGE[dtype]} {list(shp)}, "
                    f"got {arr.dtype} {list(arr.shape)}"
                )
            res[key] = arr
        return res

    def dequantize(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError


REGISTRY: dict[str, Codec] = {}


def register(cls: type[Codec]) -> type[Codec]:
    REGISTRY[cls.name] = cls()
    return cls


def dequantize_prefixed(scheme: str, tensors: dict[str, np.ndarray], prefix: str, group_size: int = 0) -> np.ndarray:
    """Dequantize Linear ``prefix`` (e.g. ``"model.layers.3.mlp.down_proj"``) from a name -> array dict
    as read back from the output files, given its type string and the ``group_size`` from
    quant_model_description.json."""
    codec = get_codec(scheme, group_size)
    parts = {}
    for key in codec.dequant_inputs:
        name = f"{prefix}.{key}"
        if name not in tensors:
            raise KeyError(f"{name} missing (needed to dequantize {scheme})")
        parts[key] = tensors[name]
    return codec.dequantize(parts)


def get_codec(name: str, group_size: int = 0) -> Codec:
    """The codec of type string ``name``, as the loader reads it under the description's ``group_size``
    (0: per channel; W4A8_DYNAMIC with G > 0: per group of G inputs; the other types ignore it)."""
    try:
        codec = REGISTRY[name]
    except KeyError:
        raise RecipeError(f"unknown scheme {name!r}; known: {', '.join(sorted(REGISTRY))}") from None
    return codec.with_group_size(group_size) if group_size else codec
