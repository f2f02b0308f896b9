"""The codec interface: one small class per quantization scheme, registered by its type string.

A codec knows three things about scheme X applied to a Linear weight ``[N, K]`` (N = out, K = in):
  * ``out_specs(shape, matmul)``: the ascendV1 tensors it writes, ``{suffix: (dtype, shape)}``,
    so a plan can size every output without reading any data;
  * ``quantize(w, matmul)``: float32 ``[N, K]`` -> ``{suffix: ndarray}`` (the plain numpy reference
    of the data-free rule); ``quantize(w, matmul, hessian=H, gptq=GPTQConfig())`` is the calibrated
    path (GPTQ error feedback on the same grid, same bytes format; see ``gptq``);
  * ``dequantize(tensors)``: the inverse, public so validation can read back output bytes.
``quantize_bf16(w_u16, matmul)`` is the fast path from raw bfloat16 bits; it must be
bit-identical to ``quantize(bf16_to_f32(w_u16), matmul)``.

A subclass supplies ``data_free_codes`` (the reference rule as codes on a ``gptq.Grid``), ``encode``
(codes -> on-disk tensors), ``gptq_grids`` (the grids the calibrated path may use) and the numba
fast path ``_quantize_bf16_fast``.

``matmul`` is the role of the Linear in an MLP (``"gate"``, ``"up"``, ``"down"`` or None), decided
by the model spec; only W4A8_DYNAMIC uses it (``scale_bias`` shape).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..dtypes import bf16_to_f32
from ..errors import RecipeError


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


class Codec:
    name: ClassVar[str]
    #: rank in model_quant_type ordering (highest present wins); None never counts
    rank: ClassVar[int | None] = None
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

    def quantize(
        self, w: np.ndarray, matmul: str | None = None, hessian: np.ndarray | None = None, gptq=None
    ) -> dict[str, np.ndarray]:
        """float32 ``w`` [N, K] -> the on-disk tensors ``{suffix: ndarray}``.

        hessian: None for the data-free rule (the plain numpy reference the kernels match), or the
            statistic of this Linear's inputs, ``(1/n) sum_t x_t x_t^T`` [K, K] (float64 or float32)
            over the n calibration tokens reaching it: then GPTQ-class error feedback on the same
            grid (``gptq.gptq_quantize``), written in the same format.
        gptq: a ``gptq.GPTQConfig`` (None: its defaults); ignored without a hessian, so callers may
            pass one config for every tensor and None hessians where calibration did not reach.
        """
        w = np.ascontiguousarray(w, dtype=np.float32)
        self.require(w.shape, matmul)
        if hessian is not None:
            from .gptq import gptq_quantize

            return gptq_quantize(self, w, matmul, hessian, gptq)
        grid, codes = self.data_free_codes(w, matmul)
        return self.encode(codes, grid, matmul)

    def data_free_codes(self, w: np.ndarray, matmul: str | None):
        """The data-free rule as (gptq.Grid, codes [N, K]) (w float32, already checked)."""
        raise NotImplementedError

    def gptq_grids(self, w: np.ndarray, matmul: str | None):
        """Candidate grids for the calibrated path (default: the data-free rule's scales)."""
        return [self.data_free_codes(w, matmul)[0]]

    def encode(self, codes: np.ndarray, grid, matmul: str | None) -> dict[str, np.ndarray]:
        """Codes on ``grid`` -> the on-disk tensors (the format of ``out_specs``)."""
        raise NotImplementedError

    def quantize_bf16(
        self, w_u16: np.ndarray, matmul: str | None = None, out: dict[str, np.ndarray] | None = None,
        hessian: np.ndarray | None = None, gptq=None,
    ) -> dict[str, np.ndarray]:
        """Fast path from bf16 bits.  ``out`` (optional): preallocated arrays for some or all
        suffixes (C-contiguous, dtype/shape as ``out_specs``); they are filled and returned.
        With a ``hessian`` this is the calibrated path of ``quantize`` (torch, not numba)."""
        if hessian is None:
            return self._quantize_bf16_fast(w_u16, matmul, out)
        res = self.quantize(bf16_to_f32(w_u16), matmul, hessian, gptq)
        if out:
            for key, arr in self.alloc(w_u16.shape, matmul, out).items():
                arr[...] = res[key]
                res[key] = arr
        return res

    def _quantize_bf16_fast(self, w_u16, matmul, out):
        res = self.quantize(bf16_to_f32(w_u16), matmul)
        if out:
            for key, arr in self.alloc(w_u16.shape, matmul, out).items():
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
