"""One output shard written in parts by many workers at once, hashed in order as the parts land.

The plan fixes every output tensor's dtype and shape, so a shard's header and each tensor's byte
offset are known before any tensor is quantized. The driver opens the shard (``ShardAssembly``):
it writes the header into ``<name>.<token>.partial``; workers (``PartWriter``) write their tensors
at their offsets, in any order and on any node that mounts the output; a driver thread hashes the
file's completed prefix as it grows, and once every part is in, fsyncs and renames it. The bytes
are exactly those the streaming ``ShardWriter`` writes, and a file under its final name is
complete, as before.

When the writers are on other nodes (Ray), the driver does not read every shard back through its
own link: ``ShardAssembly(hash_here=False)`` only creates the file, and once every part is in, one
worker hashes, fsyncs and renames it (``finish_shard``), wherever it runs.

The random token in the temporary name means a worker of a dead run (its driver SIGKILLed) can
never write into the file of a resumed run: it finds its own file gone and stops.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import re
import secrets
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from ..dtypes import nbytes
from ..errors import KimiQuantError
from ..hashing import BackgroundSha256, sha256_fd
from .atomic import disk_full, fsync_dir
from .safetensors_writer import encode_header

HASH_CHUNK = 16 * 1024 * 1024
#: what a part writer keeps in memory, at most, while another writer of its node has its turn at the file
HOLD_BYTES = 32 * 1024 * 1024
#: flock's errors where the file system has no such lock: the writer goes on without turns
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
#: file systems whose ``flock`` stays on the node. Over NFS, CIFS, Lustre, ... it is a network lock,
#: and a lock server that does not answer would stall every writer: writers there take no turns.
LOCAL_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs",
                                "bcachefs", "overlay"})


def on_local_file_system(path: str | Path, mountinfo: str | None = None) -> bool:
    """Whether ``path`` lies on one of ``LOCAL_FILE_SYSTEMS``: the type of the last mount on the
    longest mount point above it in ``mountinfo`` (default: /proc/self/mountinfo); False if unknown."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo") as f:
                mountinfo = f.read()
        except OSError:
            return False
    target = os.path.realpath(path)
    best, fstype = "", None
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        fields = fields.split()
        if len(fields) < 5 or not rest.split():
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040 is a space
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, rest.split()[0]
    return fstype in LOCAL_FILE_SYSTEMS


def tensor_offsets(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
                   ) -> tuple[bytes, dict[str, int], int]:
    """(header bytes, absolute file offset of each tensor, file size) of the shard ``entries`` make."""
    header = encode_header(entries, metadata)
    offsets, at = {}, len(header)
    for name, dtype, shape in entries:
        offsets[name] = at
        at += nbytes(dtype, shape)
    return header, offsets, at


class ShardAssembly:
    """The driver's side of one shard: create it, learn which byte ranges are written (``written``),
    and get ``done``, a Future of ``(size, sha256)`` set once the file is complete under its final name.
    With ``hash_here=False`` nothing is hashed here: ``finish_shard`` (in a worker) completes the file."""

    def __init__(self, path: str | Path, entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, hash_here: bool = True):
        self.path = Path(path)
        self.tmp = self.path.with_name(f"{self.path.name}.{secrets.token_hex(6)}.partial")
        header, self.offsets, self.size = tensor_offsets(entries, metadata)
        self.done: Future = Future()
        self._ranges: dict[int, int] = {0: len(header)}  # start -> end of written ranges not yet hashed
        self._cv = threading.Condition()
        self._aborted = False
        self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(self._fd, self.size)  # sized up front: parts land anywhere, in any order
            _pwrite_all(self._fd, memoryview(header), 0)
        except OSError as e:
            self._discard()
            if e.errno == errno.ENOSPC:
                raise disk_full(self.path, e) from None
            raise
        self._thread = None
        if not hash_here:
            os.close(self._fd)
            self._fd = None
            return
        self._thread = threading.Thread(target=self._hash_and_commit, name=f"kq-hash-{self.path.name}", daemon=True)
        self._thread.start()

    def written(self, start: int, end: int) -> None:
        """Bytes ``[start, end)`` are in the file (a part's worker returned)."""
        if end > start:
            with self._cv:
                self._ranges[start] = end
                self._cv.notify()

    def _next_range(self, at: int) -> int | None:
        """End of the written range that starts at ``at`` (waits for it); None when aborted."""
        with self._cv:
            while at not in self._ranges and not self._aborted:
                self._cv.wait()
            return None if self._aborted else self._ranges.pop(at)

    def _hash_and_commit(self) -> None:
        sha, at = hashlib.sha256(), 0
        try:
            while at < self.size:  # the header is written up front: the size is never 0
                end = self._next_range(at)
                if end is None:
                    return
                # mapped anew for each range (no copy): on NFS an open revalidates this node's cache, so bytes
                # another node wrote (and closed, see PartWriter.close) are read, never a stale page read ahead
                with open(self.tmp, "rb") as f, _map_read_once(f.fileno(), self.size) as m:
                    view = memoryview(m)
                    try:
                        while at < end and not self._aborted:
                            n = min(HASH_CHUNK, end - at)
                            sha.update(view[at:at + n])
                            at += n
                    finally:
                        view.release()
            if self._aborted:
                return
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent)
        except BaseException as e:  # noqa: BLE001 - delivered to the driver through ``done``
            self._discard()
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                e = disk_full(self.path, e)
            self.done.set_exception(e)
            return
        self.done.set_result((self.size, sha.hexdigest()))

    def _discard(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        self.tmp.unlink(missing_ok=True)

    def abort(self) -> None:
        """Stop and remove the temporary file (workers still writing into it write into nothing)."""
        with self._cv:
            self._aborted = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
        if not self.done.done():
            self._discard()


def _map_read_once(fd: int, length: int) -> mmap.mmap:
    """A read-only mapping of the shard just written, advised ``MADV_SEQUENTIAL``: the kernel then keeps
    no recency for its pages, and unmapping them no longer marks each page accessed under the LRU lock,
    batch by batch (perf, 950dt bench run: munmap 3.2% -> 1.2% of all samples). Only here: the bytes
    were just written, so they are in the page cache and read-ahead does not matter. On the source,
    faults would read ahead in small folios (a run from a cold cache took twice as long), and
    ``POSIX_FADV_NOREUSE``, which leaves read-ahead alone, is ignored on tmpfs."""
    m = mmap.mmap(fd, length, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_SEQUENTIAL"):
        try:
            m.madvise(mmap.MADV_SEQUENTIAL)
        except OSError:
            pass
    return m


def finish_shard(tmp: str | Path, path: str | Path, size: int) -> str:
    """Complete a shard whose parts are all written: sha256 it, fsync, rename to ``path``; its sha256.
    Hashed through the descriptor whose size was checked, never by name again."""
    tmp, path = Path(tmp), Path(path)
    try:
        fd = os.open(tmp, os.O_RDONLY)
    except FileNotFoundError:
        raise KimiQuantError(f"{tmp} is gone: the run converting {path.name} was stopped") from None
    try:
        if os.fstat(fd).st_size != size:
            raise KimiQuantError(f"{tmp}: {os.fstat(fd).st_size} bytes, expected {size}")
        sha = sha256_fd(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return sha


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf.nbytes:
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


class PartWriter:
    """A worker's side: writes tensors of one part into an existing shard file at their offsets.

    Same ``write`` / ``write_chunks`` calls as ``ShardWriter``; the shard is never created here, so a
    worker of a stopped run (its file removed by the driver) can leave nothing behind.

    ``whole``: this part is the whole shard (tensors arrive front to back): the writer hashes the
    header and every byte it writes, on a thread of its own (``BackgroundSha256``: a shard of copied
    bytes costs about as much to hash as to write, and the two overlap), and ``commit`` fsyncs and
    renames the file: no second read of the shard, no driver thread.

    ``take_turns``: writers on this node take turns (``flock`` on the file) to write into it. Writes
    into one file are serialized by its inode lock anyway (tmpfs, ext4, xfs), and the kernel spins
    on that lock while its holder copies: two workers writing one tmpfs file burned 1.26 core-s
    where two files took 0.81 (same bytes). ``flock`` sleeps instead, so the driver's hash thread
    gets the core; and a writer whose turn has not come keeps what ``write`` gave it (up to
    ``HOLD_BYTES``) and goes on converting, to write it at its next turn. Only where ``flock`` is
    local (``on_local_file_system``), and never across nodes."""

    def __init__(self, tmp: str | Path, offsets: dict[str, int], entries: dict[str, tuple[str, tuple[int, ...]]],
                 shard: str, whole: bool = False, take_turns: bool = False):
        self.tmp, self.offsets, self.entries, self.shard = Path(tmp), offsets, entries, shard
        self._turns = take_turns and not whole  # a whole shard has no other writer
        self._held: list[tuple[memoryview, int]] = []  # (bytes, offset) waiting for this writer's turn
        self._held_bytes = 0
        try:
            self._fd = os.open(self.tmp, os.O_RDWR if whole else os.O_WRONLY)
        except FileNotFoundError:
            raise KimiQuantError(f"{self.tmp} is gone: the run converting {shard} was stopped") from None
        self._sha = self._at = None
        if whole:  # the header the driver wrote is all that precedes the first tensor
            self._at = min(offsets.values(), default=None)
            if self._at is None:
                self._at = os.fstat(self._fd).st_size
            self._sha = BackgroundSha256(os.pread(self._fd, self._at, 0))

    def _size(self, name: str) -> int:
        dtype, shape = self.entries[name]
        return nbytes(dtype, shape)

    def _put(self, buf: memoryview, offset: int, keep: bool = False) -> None:
        """Write ``buf`` at ``offset``; ``keep``: the caller never changes it, so it may wait for a turn."""
        if self._sha is not None:
            if offset != self._at:
                raise RuntimeError(f"whole-shard writer for {self.shard}: bytes at {offset}, expected {self._at}")
            self._sha.update(buf)
            self._at += buf.nbytes
        if not self._turns:
            self._pwrite(buf, offset)
            return
        self._held.append((buf, offset))
        self._held_bytes += buf.nbytes
        self._write_held(wait=not keep or self._held_bytes > HOLD_BYTES)

    def _write_held(self, wait: bool) -> None:
        """Write what this writer holds at its turn: now (``wait``), or only if no other writer has the file."""
        if not self._held:
            return
        turn = self._take_turn(wait)
        if turn is None:
            return
        try:
            for buf, offset in self._held:
                self._pwrite(buf, offset)
            self._held, self._held_bytes = [], 0
        finally:
            if turn:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _take_turn(self, wait: bool) -> bool | None:
        """True: this writer has the file; None: another has it (only without ``wait``); False: the
        file system has no such lock, and this writer goes on without turns."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
            self._turns = False
            return False
        return True

    def _pwrite(self, buf: memoryview, offset: int) -> None:
        try:
            _pwrite_all(self._fd, buf, offset)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise disk_full(self.tmp.parent / self.shard, e) from None
            raise

    def write(self, name: str, data) -> None:
        """Write tensor ``name``; ``data`` must not change afterwards: taking turns, it may be written
        later (at a next ``write`` or ``close``). ``write_chunks`` writes each chunk before the next.
        A whole writer hashes what either is given later, on its hash thread: that must not change either."""
        buf = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else memoryview(data).cast("B")
        if buf.nbytes != self._size(name):
            raise RuntimeError(f"part of {self.shard}: {name} has {buf.nbytes} bytes, expected {self._size(name)}")
        self._put(buf, self.offsets[name], keep=True)

    def write_chunks(self, name: str, chunks) -> None:
        at = start = self.offsets[name]
        for chunk in chunks:
            buf = memoryview(np.ascontiguousarray(chunk)).cast("B")
            self._put(buf, at)
            at += buf.nbytes
        if at - start != self._size(name):
            raise RuntimeError(f"part of {self.shard}: {name} has {at - start} bytes, expected {self._size(name)}")

    def after_hashed(self, fn) -> None:
        """Call ``fn()`` once the bytes written so far are hashed: on a whole writer's hash thread when it
        gets there, else now (the driver hashes the file). For dropping the source pages they came from."""
        if self._sha is not None:
            self._sha.after(fn)
        else:
            fn()

    def commit(self) -> tuple[int, str]:
        """A ``whole`` writer's last step: fsync, rename to the shard's final name; (size, sha256)."""
        path = self.tmp.parent / self.shard
        try:
            if os.fstat(self._fd).st_size != self._at:
                raise RuntimeError(f"whole-shard writer for {self.shard}: {self._at} bytes written, file has "
                                   f"{os.fstat(self._fd).st_size}")
            os.fsync(self._fd)  # while the last bytes are hashed
            sha256 = self._sha.hexdigest()
        finally:
            self.close()
        try:
            os.replace(self.tmp, path)
        except FileNotFoundError:
            raise KimiQuantError(f"{self.tmp} is gone: the run converting {self.shard} was stopped") from None
        fsync_dir(path.parent)
        return self._at, sha256

    def close(self, sync: bool = False, write_held: bool = True) -> None:
        """Write what this writer still holds (unless not ``write_held``: after an error) and close.
        ``sync``: flush this part to stable storage now. A shard's writers are on other nodes (Ray),
        where the driver's fsync of the whole file reaches only its own node's cache."""
        if self._fd is None:
            return
        try:
            if write_held:
                self._write_held(wait=True)
            if sync:
                os.fdatasync(self._fd)
        finally:
            if self._sha is not None:
                self._sha.stop()  # a whole writer's hash thread: committed, or abandoned after an error
            os.close(self._fd)
            self._fd = None
