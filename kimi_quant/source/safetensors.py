"""Read safetensors files defensively: validate the header before trusting any offset.

Every check names the file (and tensor) in one line, so a damaged shard in a 1,000-shard
checkpoint is found at plan time, before hours of work, not as a crash hours in.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..dtypes import STORAGE, nbytes
from ..errors import BadCheckpoint
from ..untrusted import DuplicateKey, check_identity, unique_pairs

MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header: (tensors by name, __metadata__).

    Raises BadCheckpoint naming the file (and tensor) for a truncated file, a garbage or
    oversized header, unknown dtypes, offsets that overlap or run past the end of the file,
    and byte ranges that do not match dtype x shape.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return read_header_of(f, path)
    except FileNotFoundError:
        raise BadCheckpoint(f"{path}: file not found") from None


def read_header_of(f, path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """``read_header`` of the open file ``f`` (named ``path`` in errors): a reader checks and maps one
    and the same file, even if the name is pointed at another one meanwhile."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(8)
    return parse_header(head + f.read(header_length(head, size, path)), size, path)


def header_length(head: bytes, size: int, path: str | Path) -> int:
    """The header length the first 8 bytes of a file of ``size`` bytes give, once it is plausible."""
    if len(head) < 8:
        raise BadCheckpoint(f"{path}: truncated (only {size} bytes; not a safetensors file)")
    (hlen,) = struct.unpack("<Q", head[:8])
    if hlen > MAX_HEADER:
        raise BadCheckpoint(f"{path}: header length {hlen} exceeds the {MAX_HEADER}-byte limit (garbage header?)")
    if 8 + hlen > size:
        raise BadCheckpoint(f"{path}: truncated: header claims {hlen} bytes but the file has {size}")
    return hlen


def parse_header(prefix: bytes, size: int, path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The validated header of a safetensors file of ``size`` bytes that begins with ``prefix`` (the
    8-byte length and the header; more is ignored): one set of rules for a file on disk and a header
    read over the network. Errors name ``path``."""
    hlen = header_length(prefix[:8], size, path)
    raw = prefix[8:8 + hlen]
    if len(raw) < hlen:
        raise BadCheckpoint(f"{path}: header claims {hlen} bytes but only {len(raw)} could be read")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_pairs)
    except DuplicateKey as e:
        raise BadCheckpoint(f"{path}: key {e.args[0]!r} appears twice in the header (a tensor named twice?)") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise BadCheckpoint(f"{path}: header is not valid JSON (damaged or not a safetensors file)") from None
    if not isinstance(header, dict):
        raise BadCheckpoint(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BadCheckpoint(f"{path}: __metadata__ must be an object of strings, got {str(metadata)[:80]}")
    base = 8 + hlen
    data_len = size - base
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype = entry["dtype"]
            shape = tuple(_int(s) for s in entry["shape"])
            begin, end = (_int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise BadCheckpoint(f"{path}: tensor {name!r}: malformed header entry {str(entry)[:200]}") from None
        if not isinstance(dtype, str) or dtype not in STORAGE:
            raise BadCheckpoint(f"{path}: tensor {name!r}: unknown dtype {dtype!r}")
        if any(s < 0 for s in shape) or begin < 0 or end < begin:
            raise BadCheckpoint(f"{path}: tensor {name!r}: negative shape or offsets")
        if end - begin != nbytes(dtype, shape):
            raise BadCheckpoint(
                f"{path}: tensor {name!r}: {dtype}{list(shape)} needs {nbytes(dtype, shape)} bytes "
                f"but its byte range holds {end - begin}")
        if end > data_len:
            raise BadCheckpoint(
                f"{path}: tensor {name!r}: data ends at byte {base + end} but the file has {size} bytes (truncated?)")
        tensors[name] = TensorInfo(name, dtype, shape, base + begin, base + end)
    spans = sorted((t.start, t.end, t.name) for t in tensors.values() if t.end > t.start)
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise BadCheckpoint(f"{path}: tensors {n0!r} and {n1!r} overlap in the file")
    return tensors, dict(metadata)


def _int(x) -> int:
    """A JSON integer (2.5, "6", true are not shapes or offsets)."""
    if type(x) is not int:
        raise TypeError(x)
    return x


class SafetensorsReader:
    """Zero-copy tensor views over an mmap of one validated safetensors file.

    ``release(info)`` drops the pages of a tensor that has been consumed, so resident memory
    stays bounded by the tensor in flight rather than growing with the shard.
    """

    def __init__(self, path: str | Path, identity: str | None = None):
        """``identity``: the ``untrusted.file_identity`` the driver vetted; any other file is refused."""
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise BadCheckpoint(f"{self.path}: file not found") from None
        try:
            check_identity(self._file.fileno(), self.path, identity)
            self.tensors, self.metadata = read_header_of(self._file, self.path)
        except BaseException:
            self._file.close()
            raise
        size = os.fstat(self._file.fileno()).st_size
        self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when it does
            self._mmap = None
        self._file.close()

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise BadCheckpoint(f"{self.path}: tensor {name!r} is named in the index but absent from this shard") from None

    def array(self, name: str) -> np.ndarray:
        """A read-only numpy view (BF16 as uint16, F8 as uint8) of tensor ``name``."""
        t = self.info(name)
        dt = STORAGE[t.dtype]
        if t.nbytes == 0:
            return np.zeros(t.shape, dtype=dt)
        return np.frombuffer(self._mmap, dtype=dt, count=t.nbytes // dt.itemsize, offset=t.start).reshape(t.shape)

    def raw(self, name: str) -> memoryview:
        t = self.info(name)
        if t.nbytes == 0:
            return memoryview(b"")
        return memoryview(self._mmap)[t.start:t.end]

    def release(self, name: str) -> None:
        """Tell the kernel the pages of ``name`` are no longer needed (keeps RSS flat)."""
        t = self.tensors.get(name)
        if t is not None:
            self.release_range(t.start, t.nbytes)

    def release_range(self, start: int, length: int) -> None:
        if self._mmap is None or length <= 0 or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        aligned = (start // page) * page
        try:
            self._mmap.madvise(mmap.MADV_DONTNEED, aligned, length + start - aligned)
        except (OSError, ValueError):
            pass
