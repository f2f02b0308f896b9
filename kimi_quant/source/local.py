"""A checkpoint in a local directory (also a shared filesystem for distributed runs)."""

from __future__ import annotations

from pathlib import Path

from ..errors import BadCheckpoint
from .base import FileEntry, Source
from .safetensors import TensorInfo, read_header


class LocalSource(Source):
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise BadCheckpoint(f"{self.root}: not a directory")
        self.id = str(self.root)
        self.revision = None
        self._headers: dict[str, dict[str, TensorInfo]] = {}

    def files(self) -> list[FileEntry]:
        out = []
        for p in sorted(self.root.rglob("*")):
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(self.root).parts):
                st = p.stat()
                out.append(FileEntry(p.relative_to(self.root).as_posix(), st.st_size, mtime_ns=st.st_mtime_ns))
        return out

    def read_bytes(self, name: str) -> bytes:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            raise BadCheckpoint(f"{self.root / name}: not found") from None

    def header(self, name: str) -> dict[str, TensorInfo]:
        if name not in self._headers:
            path = self.root / name
            if not path.exists():
                raise BadCheckpoint(f"{path}: shard named in the index is missing")
            self._headers[name] = read_header(path)[0]
        return self._headers[name]

    def fetch(self, name: str) -> Path:
        path = self.root / name
        if not path.exists():
            raise BadCheckpoint(f"{path}: shard named in the index is missing")
        return path
