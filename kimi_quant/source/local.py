"""A checkpoint in a local directory (also a shared filesystem for distributed runs)."""

from __future__ import annotations

import os
import re
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
                rel = p.relative_to(self.root).as_posix()
                out.append(FileEntry(rel, st.st_size, sha256=hub_recorded_sha256(self.root, rel, st),
                                     mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns))
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


_SHA256 = re.compile(r"[0-9a-f]{64}")


def hub_recorded_sha256(root: Path, rel: str, st: os.stat_result) -> str | None:
    """The sha256 huggingface_hub recorded when it downloaded ``root/rel``, while it still applies
    (nothing is hashed here; the hub's LFS oid, as a hub source would list it):

    * its cache (``snapshot_download()``): ``snapshots/<commit>/<rel>`` links to ``blobs/<sha256>``;
    * ``hf download --local-dir``: ``.cache/huggingface/download/<rel>.metadata`` holds the commit,
      the etag (the sha256 for LFS files) and the download time; like huggingface_hub, the record
      counts only while the file's mtime is not later than that (1 s of slack).
    """
    path = root / rel
    if path.is_symlink():
        blob = Path(os.path.realpath(path))
        return blob.name if blob.parent.name == "blobs" and _SHA256.fullmatch(blob.name) else None
    meta = root / ".cache" / "huggingface" / "download" / f"{rel}.metadata"
    try:
        _commit, etag, when = meta.read_text().splitlines()[:3]
        fresh = st.st_mtime - 1 <= float(when)
    except (OSError, ValueError):
        return None
    etag = etag.strip()
    return etag if fresh and _SHA256.fullmatch(etag) else None
