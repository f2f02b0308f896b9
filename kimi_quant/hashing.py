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
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from .untrusted import check_identity

CHUNK = 16 * 1024 * 1024
#: bytes a ``BackgroundSha256`` may hold unhashed before ``update`` waits for its thread
BACKLOG = 64 * 1024 * 1024


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


class BackgroundSha256:
    """sha256 of bytes given in order (``update``), computed on a thread of its own: hashlib releases
    the GIL on large buffers, so a writer copies bytes on one core while they are hashed on another.

    ``update`` keeps a reference to the buffer until it is hashed: it must not change meanwhile. At
    most ``backlog`` bytes wait (then ``update`` waits), so memory stays bounded when hashing lags;
    ``after(fn)`` runs ``fn`` once the bytes given before it are hashed (e.g. drop their pages)."""

    def __init__(self, data=b"", backlog: int = BACKLOG):
        self._sha = hashlib.sha256(data)
        self._waiting: deque = deque()  # memoryviews to hash, and functions to call (``after``), in order
        self._waiting_bytes = 0
        self._backlog = backlog
        self._closed = False
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kq-sha256", daemon=True)
        self._thread.start()

    def update(self, data) -> None:
        buf = memoryview(data).cast("B")
        if not buf.nbytes:
            return
        with self._cv:
            while self._waiting_bytes >= self._backlog and not self._closed:
                self._cv.wait()
            if self._closed:
                raise RuntimeError(f"sha256 thread: update after the digest was taken or the hash stopped"
                                   f"{f' (it failed: {self._error!r})' if self._error else ''}")
            self._waiting.append(buf)
            self._waiting_bytes += buf.nbytes
            self._cv.notify_all()

    def after(self, fn) -> None:
        """Call ``fn()`` on the hash thread once every byte given so far is hashed (now, once stopped)."""
        with self._cv:
            if not self._closed:
                self._waiting.append(fn)
                self._cv.notify_all()
                return
        fn()

    def _run(self) -> None:
        try:
            self._hash_until_closed()
        except BaseException as e:  # noqa: BLE001 - raised by ``hexdigest``: never a digest of missing bytes
            with self._cv:
                self._error, self._closed = e, True
                self._waiting.clear()
                self._cv.notify_all()

    def _hash_until_closed(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if not self._waiting:
                    return
                item = self._waiting.popleft()
            if callable(item):
                item()
                continue
            for start in range(0, item.nbytes, CHUNK):
                self._sha.update(item[start:start + CHUNK])
            with self._cv:
                self._waiting_bytes -= item.nbytes
                self._cv.notify_all()
            del item  # the buffer (maybe a view of a mapped file) is not kept while waiting

    def hexdigest(self) -> str:
        """The digest of every byte given: waits for the thread to hash them all."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"sha256 thread failed: {self._error!r}") from self._error
        return self._sha.hexdigest()

    def stop(self) -> None:
        """Drop what is still waiting and end the thread (after an error: no digest is wanted)."""
        with self._cv:
            self._closed = True
            self._waiting_bytes -= sum(b.nbytes for b in self._waiting if not callable(b))
            self._waiting.clear()
            self._cv.notify_all()
        self._thread.join()
