"""A checkpoint in a local directory (also a shared filesystem for distributed runs)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import BadCheckpoint
from ..untrusted import inside, unsafe_name
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
        # a huggingface_hub cache snapshot links every file to ../../blobs/<id>: those links are its own
        cache = self.root.parent
        self._blobs = cache.parent / "blobs" if cache.name == "snapshots" and (cache.parent / "blobs").is_dir() else None

    def files(self) -> list[FileEntry]:
        out = []
        for p in sorted(self.root.rglob("*")):
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(self.root).parts):
                rel = p.relative_to(self.root).as_posix()
                self._path(rel)  # a link out of the source is refused here, before it is read or copied
                st = p.stat()
                out.append(FileEntry(rel, st.st_size, sha256=hub_recorded_sha256(self.root, rel, st),
                                     mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns))
        return out

    def _path(self, name: str) -> Path:
        """``root/name``, refused unless ``name`` is a plain relative name whose target (symlinks
        resolved) stays in the source directory, or, for a huggingface_hub cache snapshot
        (``<repo>/snapshots/<commit>/``), in that repo's ``blobs/``."""
        why = unsafe_name(name)
        if why:
            raise BadCheckpoint(f"{self.root}: file name {name!r} {why}: refusing to read outside the source")
        path = self.root / name
        if not inside(path, self.root) and not (self._blobs is not None and inside(path, self._blobs)):
            raise BadCheckpoint(f"{path}: links to {os.path.realpath(path)}, outside the source directory "
                                f"{self.root}: refusing to read or copy it (copy the file in instead)")
        return path

    def read_bytes(self, name: str) -> bytes:
        path = self._path(name)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise BadCheckpoint(f"{path}: not found") from None

    def header(self, name: str) -> dict[str, TensorInfo]:
        if name not in self._headers:
            path = self._path(name)
            if not path.exists():
                raise BadCheckpoint(f"{path}: shard named in the index is missing")
            self._headers[name] = read_header(path)[0]
        return self._headers[name]

    def roots(self) -> list[Path]:
        return [self.root] + ([self._blobs] if self._blobs is not None else [])

    def fetch(self, name: str) -> Path:
        path = self._path(name)
        if not path.exists():
            raise BadCheckpoint(f"{path}: shard named in the index is missing")
        return path


_SHA256 = re.compile(r"[0-9a-f]{64}")


def hub_recorded_sha256(root: Path, rel: str, st: os.stat_result) -> str | None:
    """The sha256 huggingface_hub recorded when it downloaded ``root/rel``, while it still applies
    (nothing is hashed here; the hub's LFS oid, as a hub source would list it). A claim only: anyone
    can name a file ``blobs/<any sha>``; the provenance keeps it apart from hashes checked
    (``--hash-inputs`` checks it):

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
    if not inside(meta, root):
        return None
    try:
        _commit, etag, when = meta.read_text().splitlines()[:3]
        fresh = st.st_mtime - 1 <= float(when)
    except (OSError, ValueError):
        return None
    etag = etag.strip()
    return etag if fresh and _SHA256.fullmatch(etag) else None
