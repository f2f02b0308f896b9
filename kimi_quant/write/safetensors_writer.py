"""A streaming safetensors writer: header first (sizes are known from the plan), tensors appended.

Bytes go to ``<name>.partial`` and are hashed as they are written; ``commit()`` fsyncs and renames,
so a file under its final name is always complete.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..dtypes import nbytes
from .atomic import disk_full, fsync_dir


def encode_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length + JSON header (padded with spaces to 8 bytes) for tensors in ``entries`` order."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, dtype, shape in entries:
        size = nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


class ShardWriter:
    """Write one safetensors file whose tensors arrive in a fixed, pre-declared order."""

    def __init__(self, path: str | Path, entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self._entries = list(entries)
        self._next = 0
        self._sha = hashlib.sha256()
        self._file = open(self.tmp, "wb")
        self.size = 0
        self._write(encode_header(self._entries, metadata))

    def _write(self, data) -> None:
        try:
            self._file.write(data)
        except OSError as e:
            self.abort()
            if e.errno == errno.ENOSPC:
                raise disk_full(self.path, e) from None
            raise
        self._sha.update(data)
        self.size += memoryview(data).nbytes

    def write(self, name: str, data: np.ndarray | bytes | memoryview) -> None:
        """Append the bytes of tensor ``name``; it must be the next one declared."""
        exp_name, dtype, shape = self._entries[self._next]
        if name != exp_name:
            raise RuntimeError(f"writer for {self.path.name}: expected tensor {exp_name}, got {name}")
        buf = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else memoryview(data).cast("B")
        if buf.nbytes != nbytes(dtype, shape):
            raise RuntimeError(f"writer for {self.path.name}: {name} has {buf.nbytes} bytes, expected {nbytes(dtype, shape)}")
        self._write(buf)
        self._next += 1

    def write_chunks(self, name: str, chunks) -> None:
        """Append tensor ``name`` from consecutive pieces (e.g. slices of an mmap), never all in memory."""
        exp_name, dtype, shape = self._entries[self._next]
        if name != exp_name:
            raise RuntimeError(f"writer for {self.path.name}: expected tensor {exp_name}, got {name}")
        total = 0
        for chunk in chunks:
            buf = memoryview(np.ascontiguousarray(chunk)).cast("B")
            self._write(buf)
            total += buf.nbytes
        if total != nbytes(dtype, shape):
            raise RuntimeError(f"writer for {self.path.name}: {name} has {total} bytes, expected {nbytes(dtype, shape)}")
        self._next += 1

    def after_hashed(self, fn) -> None:
        """Call ``fn()`` once the bytes written so far are hashed: now (they are hashed as written)."""
        fn()

    def commit(self) -> tuple[int, str]:
        """Flush, fsync and rename into place; returns (size, sha256 hex)."""
        if self._next != len(self._entries):
            raise RuntimeError(f"writer for {self.path.name}: {len(self._entries) - self._next} tensors not written")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            if e.errno == errno.ENOSPC:
                raise disk_full(self.path, e) from None
            raise
        fsync_dir(self.path.parent)
        return self.size, self._sha.hexdigest()

    def abort(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass  # closing flushes the buffer, which fails again on a full disk: the file goes anyway
        finally:
            self.tmp.unlink(missing_ok=True)
