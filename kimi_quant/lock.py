"""One kimi-quant run per directory: an advisory lock (flock) on a file in it that names the holder's pid.

The lock goes with the process (a crash or kill -9 releases it), so there is never a stale lock to
clean up; the file stays behind, empty of meaning until the next run writes its own pid.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Callable

from .errors import KimiQuantError


class DirLock:
    def __init__(self, path: str | Path, busy: Callable[[str], KimiQuantError], remove: bool = False):
        """``busy(pid)``: the one-line error raised when another process holds ``path``.  ``remove``: delete
        the lock file on release (an output directory then holds only what the conversion made)."""
        self.path = Path(path)
        self._busy = busy
        self._remove = remove
        self._fd: int | None = None
        self.found = False  # the file was there before acquire() (left by a killed run)

    def acquire(self) -> "DirLock":
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.found = os.path.lexists(self.path)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise self._busy(holder) from None
            st = os.fstat(fd)
            try:
                cur = os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                cur = None
            if cur is not None and (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
                break
            os.close(fd)  # its holder removed the file between our open and our lock: lock the new one
        self._before = os.pread(fd, 64, 0)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, keep_file: bool = False) -> None:
        """``keep_file``: leave the file as it was found even where ``remove`` was asked (a refused run
        leaves a directory exactly as it found it, a stale lock file included)."""
        if self._fd is not None:
            if keep_file:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, self._before, 0)
            elif self._remove:
                self.path.unlink(missing_ok=True)  # while still held: a waiting opener sees the inode change
            os.close(self._fd)  # releases the lock
            self._fd = None


OUTPUT_LOCK = ".kimi_quant.lock"  # a dot-file: never published, never taken for a user's file


def output_lock(out_dir: str | Path) -> DirLock:
    """The lock of an output directory (acquire() it): one conversion (or validation) writes there at a time."""
    out_dir = Path(out_dir)
    return DirLock(out_dir / OUTPUT_LOCK, lambda pid: KimiQuantError(
        f"{out_dir} is being written by another kimi-quant run (pid {pid}); wait for it to end, or choose "
        "another --output"), remove=True)
