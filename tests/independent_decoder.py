"""An ascendV1 decoder written only from shared/spec/formats.md, sharing no code with kimi_quant.

Used by the end-to-end tests to read back a converted checkpoint with a second, independent
implementation of the format: if the writer and this reader agree, the format is right twice.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_NP = {"BF16": np.uint16, "F32": np.float32, "F16": np.float16, "I8": np.int8, "U8": np.uint8, "F8_E4M3": np.uint8}
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def read_safetensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        arr = np.frombuffer(raw[8 + n + b: 8 + n + end], dtype=_NP[e["dtype"]]).reshape(e["shape"])
        out[name] = (e["dtype"], arr)
    return out


def read_checkpoint(directory: Path, index_name: str) -> dict[str, tuple[str, np.ndarray]]:
    index = json.loads((Path(directory) / index_name).read_text())
    tensors = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(read_safetensors(Path(directory) / f))
    assert set(tensors) == set(index["weight_map"]), "index and shards disagree"
    return tensors


def bf16(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def e4m3(bits: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bit patterns -> float32 (bias 7, no inf, 0x7F/0xFF NaN)."""
    b = bits.astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where((exp == 0xF) & (man == 0x7), np.nan, val)
    return (sign * val).astype(np.float32)


def e8m0(byte: np.ndarray) -> np.ndarray:
    return np.exp2(byte.astype(np.float32) - 127)


def decode_linear(kind: str, t: dict[str, np.ndarray]) -> np.ndarray:
    """Dequantize one Linear from its ascendV1 tensors (suffix -> array)."""
    if kind == "W4A8_DYNAMIC":
        packed = t["weight"].view(np.uint8)
        lo = (packed & 0xF).astype(np.int8)
        hi = (packed >> 4).astype(np.int8)
        lo = np.where(lo > 7, lo - 16, lo)
        hi = np.where(hi > 7, hi - 16, hi)
        q = np.empty((2 * packed.shape[0], packed.shape[1]), np.int8)
        q[0::2], q[1::2] = lo, hi  # packed along N: row 2j low nibble, row 2j+1 high nibble
        return q.astype(np.float32) * t["weight_scale"]
    if kind == "W8A8_DYNAMIC":
        return t["weight"].astype(np.float32) * t["weight_scale"]
    if kind == "W4A8_MXFP":
        packed = t["weight"]
        codes = np.empty((packed.shape[0], 2 * packed.shape[1]), np.uint8)
        codes[:, 0::2], codes[:, 1::2] = packed & 0xF, packed >> 4  # along K, element 2i low nibble
        return E2M1[codes] * np.repeat(e8m0(t["weight_scale"]), 32, axis=1)
    if kind == "W8A8_MXFP8":
        return e4m3(t["weight"]) * np.repeat(e8m0(t["weight_scale"]), 32, axis=1)
    raise ValueError(kind)


def int4_codes(t: dict[str, np.ndarray]) -> np.ndarray:
    packed = t["weight"].view(np.uint8)
    lo = (packed & 0xF).astype(np.int16)
    hi = (packed >> 4).astype(np.int16)
    q = np.empty((2 * packed.shape[0], packed.shape[1]), np.int16)
    q[0::2], q[1::2] = np.where(lo > 7, lo - 16, lo), np.where(hi > 7, hi - 16, hi)
    return q


def expected_scale_bias(t: dict[str, np.ndarray], down: bool) -> np.ndarray:
    q = int4_codes(t).astype(np.float64)
    s = t["weight_scale"].astype(np.float64)
    if not down:
        return 8 * q.sum(1, keepdims=True) * s
    N, K = q.shape
    return 8 * q.reshape(N, 16, K // 16).sum(2) * s
