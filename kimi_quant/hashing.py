"""sha256 of files: one at a time from an mmap, or many at once on every core.

Checking a big output again (a resumed run re-hashes the shards it keeps; ``verify`` re-hashes all)
is ~0.55 core-s per GB: 1.5 TB of K3.1 output is ~14 min on one core.  hashlib releases the GIL
on large buffers, so ``sha256_files`` runs one thread per core (and keeps the disk's queue busy)
and can drive a progress bar.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from .untrusted import check_identity

CHUNK = 16 * 1024 * 1024


def sha256_file(path: str | Path, progress: Callable[[int], None] | None = None, identity: str | None = None) -> str:
    """sha256 of a file, hashed straight from an mmap (no copy), dropping pages as it goes;
    ``progress(n)`` after each chunk of n bytes. ``identity``: refuse any file but the one vetted
    (``untrusted.check_identity``)."""
    with open(path, "rb") as f:
        check_identity(f.fileno(), path, identity)
        return sha256_fd(f.fileno(), progress)


def sha256_fd(fd: int, progress: Callable[[int], None] | None = None) -> str:
    """sha256 of the file open as ``fd`` (readable), from its start to its current end (see ``sha256_file``)."""
    h = hashlib.sha256()
    size = os.fstat(fd).st_size
    if size == 0:
        return h.hexdigest()
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        try:
            for start in range(0, size, CHUNK):
                n = min(CHUNK, size - start)
                h.update(view[start:start + n])
                if hasattr(mmap, "MADV_DONTNEED"):
                    m.madvise(mmap.MADV_DONTNEED, start, n)
                if progress:
                    progress(n)
        finally:
            view.release()
    return h.hexdigest()


def sha256_files(paths: list[Path], desc: str | None = None, quiet: bool = False,
                 workers: int | None = None) -> list[str]:
    """sha256 of each of ``paths`` (in order), hashed in parallel; a progress bar labelled ``desc``
    (with ETA) unless ``quiet`` or there is under ~1 GB to hash."""
    if not paths:
        return []
    from .progress import NoBar, progress_bar

    total = sum(os.path.getsize(p) for p in paths)
    bar = NoBar(total) if quiet or desc is None or total < 1 << 30 else progress_bar(total, desc)
    lock = threading.Lock()

    def advance(n: int) -> None:
        with lock:
            bar.update(n)

    workers = max(1, min(len(paths), workers or os.cpu_count() or 1))
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="kq-sha256") as pool:
            return list(pool.map(lambda p: sha256_file(p, advance), paths))
    finally:
        bar.close()
