"""safetensors dtype strings and their numpy storage types.

numpy has no bfloat16 or float8, so those are carried as same-width unsigned integers
(BF16 -> uint16, F8_E4M3 -> uint8) and converted explicitly where numbers are needed.
"""

from __future__ import annotations

import numpy as np

# safetensors dtype -> (numpy storage dtype, itemsize)
STORAGE: dict[str, np.dtype] = {
    "BF16": np.dtype(np.uint16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32),
    "U64": np.dtype(np.uint64),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
    "F8_E8M0": np.dtype(np.uint8),
}


def itemsize(dtype: str) -> int:
    return STORAGE[dtype].itemsize


def nbytes(dtype: str, shape) -> int:
    n = STORAGE[dtype].itemsize
    for s in shape:
        n *= int(s)
    return n


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """Exact widening of bfloat16 bit patterns (uint16) to float32."""
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bit patterns (uint16); NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def to_f32(arr: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 copy of a floating tensor given its safetensors dtype."""
    if dtype == "BF16":
        return bf16_to_f32(arr)
    if dtype in ("F16", "F32", "F64"):
        return arr.astype(np.float32)
    raise TypeError(f"dtype {dtype} is not a float type")


#: exponent field of the float8/bfloat16 formats stored as unsigned ints: all ones is NaN (or Inf)
_ALL_ONES_BITS = {"BF16": 0x7F80, "F8_E4M3": 0x7F, "F8_E5M2": 0x7C, "F8_E8M0": 0xFF}

#: elements per step of ``nonfinite``: its scratch stays in cache and is reused, where one whole-tensor
#: temporary per test was fresh memory that the kernel had to zero (~0.1 core-s per 200 MB here)
_SCAN_BLOCK = 1 << 16


def nonfinite(arr: np.ndarray, dtype: str) -> bool:
    """Whether a tensor (its storage array, any shape) holds a NaN or an Inf of its float ``dtype``;
    False for integer dtypes. F8_E5M2 has Inf and NaN (exponent all ones), F8_E4M3 (fn) only NaN
    (S.1111.111), F8_E8M0 only NaN (0xFF)."""
    bits = _ALL_ONES_BITS.get(dtype)
    if bits is None and dtype not in ("F16", "F32", "F64"):
        return False
    flat = np.ravel(arr)
    n = min(flat.size, _SCAN_BLOCK)
    scratch = np.empty(n, np.bool_ if bits is None else flat.dtype)
    for i in range(0, flat.size, _SCAN_BLOCK):
        block = flat[i:i + _SCAN_BLOCK]
        if bits is None:
            bad = not np.isfinite(block, out=scratch[:block.size]).all()
        else:  # x & bits == bits for some x <=> max(x & bits) == bits: one SIMD reduction, no bool pass
            bad = np.bitwise_and(block, bits, out=scratch[:block.size]).max() == bits
        if bad:
            return True
    return False
