"""Hub shards staged on local disk: downloaded ahead of use within a disk window, verified, released.

``prefetch(order)`` starts background downloads in that order, bounded by a window (``max_disk``
bytes and/or ``lookahead`` shards staged but not yet released); ``fetch`` blocks until a shard is in
``work_dir``, complete and verified against the hub's id (the LFS sha256, or the git blob sha1 of a
small file); ``release`` deletes the staged copy (unless ``keep_source``).

On disk, under ``work_dir``::

    <name>                        a verified file
    .kq-hub/partial/<name>        a download in progress (resumed with HTTP Range when the server allows;
                                  the hash is taken as the bytes arrive, so a resumed file is read once)
    .kq-hub/verified/<name>.json  {digest, size, mtime_ns}: the file next to it was verified, so a rerun
                                  does not download it again (it re-hashes it once before use)

The directory may have been written by anyone who could write there before: a link placed at a
partial file is never written through, a file planted at a shard's name is used only once its bytes
hash right, and a download that runs past its listed size or ends short is retried, never kept.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx2

from ..cache import private_dir, write_private
from ..errors import KimiQuantError
from ..hub_http import NETWORK_ERRORS, HubError, Transient
from ..lock import DirLock
from .base import FileEntry
from .hub_client import HubClient

log = logging.getLogger(__name__)

CHUNK = 8 << 20
META_DIR = ".kq-hub"
DEFAULT_LOOKAHEAD = 2  # shards staged at once (the one being converted + one ahead) when no bound is given
DOWNLOAD_TIMEOUT = httpx2.Timeout(60.0, connect=30.0)


class Stager:
    """Files of ``client``'s repo staged under ``work_dir``; ``entry(name)`` and ``blob_id(name)`` say
    what each must be (size, sha256; git blob id)."""

    def __init__(self, client: HubClient, work_dir: Path, entry: Callable[[str], FileEntry],
                 blob_id: Callable[[str], str | None], max_disk: int | None = None, lookahead: int | None = None,
                 keep_source: bool = False, workers: int = 2):
        self.client = client
        self.work_dir = work_dir
        self.entry = entry
        self.blob_id = blob_id
        self.max_disk = int(max_disk) if max_disk is not None else None
        if lookahead is None and max_disk is None:
            lookahead = DEFAULT_LOOKAHEAD
        self.lookahead = lookahead
        self.keep_source = keep_source
        self.workers = max(1, int(workers))
        self.tries = client.backoff.tries
        self.hashed: set[str] = set()  # staged files hashed by this process (see verified)
        self.lock = DirLock(work_dir / META_DIR / "lock", lambda pid: HubError(
            f"{work_dir} is staging shards for another kimi-quant run (pid {pid}); wait for it to end, "
            "or give this run its own --work-dir"))  # taken once this run stages (see claim_work_dir)
        # the window, guarded by _cv
        self._cv = threading.Condition()
        self._plan: list[str] = []
        self._cursor = 0
        self._state: dict[str, str] = {}  # name -> "downloading" | "ready" | "failed" | "released"
        self._errors: dict[str, BaseException] = {}
        self._reserved: dict[str, int] = {}  # staged (or being staged) and not released: name -> bytes
        self.staged_bytes = 0
        self.peak_staged_bytes = 0
        self.downloaded_bytes = 0  # bytes actually transferred in this process
        self.threads: list[threading.Thread] = []
        self._closed = False

    # -- what a file must be -----------------------------------------------------------------------
    def expected_digest(self, name: str) -> str | None:
        ent = self.entry(name)
        if ent.sha256:
            return "sha256:" + ent.sha256
        blob = self.blob_id(name)
        return "gitsha1:" + blob if blob else None

    def new_hasher(self, name: str):
        ent = self.entry(name)
        if ent.sha256:
            return hashlib.sha256(), "sha256:"
        h = hashlib.sha1()
        h.update(b"blob %d\0" % ent.size)  # git's blob id: the header, then the bytes
        return h, "gitsha1:"

    def digest_bytes(self, data: bytes, name: str) -> str:
        h, tag = self.new_hasher(name)
        h.update(data)
        return tag + h.hexdigest()

    def digest_file(self, path: Path, name: str) -> str:
        h, tag = self.new_hasher(name)
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        return tag + h.hexdigest()

    # -- verified files --------------------------------------------------------------------------
    def marker(self, name: str) -> Path:
        return self.work_dir / META_DIR / "verified" / (name + ".json")

    def partial(self, name: str) -> Path:
        return self.work_dir / META_DIR / "partial" / name

    def verified(self, name: str, strict: bool = True) -> bool:
        """``work_dir/name`` exists and is the verified file for this revision.

        A marker left by an earlier run proves only that the file was right then (a disk error or an
        edit that restores the mtime leaves it in place): ``strict`` (conversion and small files)
        re-hashes such a file once per process, which spares the download but not the check;
        planning (``header``) trusts the marker, as the shard is checked again before it is converted."""
        ent = self.entry(name)
        path = self.work_dir / name
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        if st.st_size != ent.size:
            return False
        if name in self.hashed:
            return True
        want = self.expected_digest(name)
        try:
            m = json.loads(self.marker(name).read_text())
            if m.get("digest") == want and m.get("size") == st.st_size and m.get("mtime_ns") == st.st_mtime_ns:
                if not strict:
                    return True
        except (OSError, ValueError):
            pass
        if want is None:
            return False
        if self.digest_file(path, name) == want:  # an earlier run's file, with or without its marker
            self.mark(name)
            return True
        return False

    def mark(self, name: str) -> None:
        """Record ``name`` as hashed and right, in this process and (the marker) for later runs."""
        self.hashed.add(name)
        st = (self.work_dir / name).stat()
        m = self.marker(name)
        private_dir(m.parent, "hub staging")
        write_private(m, json.dumps({"digest": self.expected_digest(name), "size": st.st_size,
                                     "mtime_ns": st.st_mtime_ns, "revision": self.client.revision}).encode())

    def forget(self, name: str) -> None:
        """Delete the staged copy of ``name`` and its marker."""
        self.hashed.discard(name)
        (self.work_dir / name).unlink(missing_ok=True)
        self.marker(name).unlink(missing_ok=True)

    def os_error(self, e: OSError, name: str) -> KimiQuantError:
        if e.errno == errno.ENOSPC:
            free = shutil.disk_usage(self.work_dir).free if self.work_dir.exists() else 0
            return HubError(f"{self.work_dir}: disk full while downloading {name} ({free} bytes free): "
                            "free space or lower --max-disk")
        if isinstance(e, KimiQuantError):
            return e
        return HubError(f"{self.client.label(name)}: {type(e).__name__}: {e}")

    # -- downloading -------------------------------------------------------------------------------
    def open_partial(self, part: Path, mode: str):
        """The partial file, opened without following a link and only when it is a plain file of ours:
        its name is predictable (a resumed download finds it again), so in a directory another user could
        write, a link placed there would have the download written through it into someone's file. The
        staging folders are private (``cache.private_dir``)."""
        private_dir(self.work_dir / META_DIR, "hub staging")
        private_dir(part.parent, "hub staging")
        flags = os.O_NOFOLLOW | (os.O_RDWR | os.O_CREAT if mode != "rb" else os.O_RDONLY)
        fd = os.open(part, flags, 0o600)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            os.close(fd)
            raise HubError(f"{part}: not a plain file of yours; remove it (the staging area is kimi-quant's)")
        if mode == "wb":
            os.ftruncate(fd, 0)
        return os.fdopen(fd, "rb" if mode == "rb" else "r+b")

    def download(self, name: str) -> Path:
        """Download ``name`` into work_dir, resuming a partial file, and verify it; one re-download on mismatch."""
        final = self.work_dir / name
        if self.verified(name):
            return final
        ent = self.entry(name)
        want = self.expected_digest(name)
        for round_ in (1, 2):
            got = self.download_once(name, ent.size)
            if want is None or got == want:
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self.partial(name), final)
                self.mark(name)
                return final
            self.partial(name).unlink(missing_ok=True)
            log.warning("hub: %s: checksum mismatch (round %d); downloading again from zero", name, round_)
        raise HubError(f"{self.client.label(name)}: downloaded bytes do not match the hub's checksum twice "
                       f"(expected {want}, got {got}): the hub copy is damaged")

    def download_once(self, name: str, size: int) -> str:
        """Stream ``name`` into its partial file (resuming with Range), retrying transient errors; its digest."""
        part = self.partial(name)
        part.parent.mkdir(parents=True, exist_ok=True)
        backoff = self.client.backoff
        last: BaseException | None = None
        for attempt in range(self.tries):
            backoff.check()
            have = part.lstat().st_size if part.exists() and not part.is_symlink() else 0
            if have > size or part.is_symlink():
                part.unlink()
                have = 0
            try:
                return self._transfer(name, part, have, size)
            except (Transient, *NETWORK_ERRORS) as e:
                last = e
                if attempt + 1 < self.tries:
                    backoff.wait(attempt, getattr(e, "retry_after", None))
            except OSError as e:
                raise self.os_error(e, name) from None
        raise HubError(f"{self.client.label(name)}: download failed after {self.tries} tries: {last}")

    def _transfer(self, name: str, part: Path, have: int, size: int) -> str:
        """One GET of ``name`` from byte ``have`` into ``part``, hashing as it goes: the digest of the whole file."""
        h, tag = self.new_hasher(name)
        if have == size:
            with self.open_partial(part, "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
            return tag + h.hexdigest()
        with self.client.stream(name, have, timeout=DOWNLOAD_TIMEOUT) as r:
            resumed = have and r.status_code == 206 and r.headers.get("Content-Range", "").startswith(
                f"bytes {have}-")
            if not resumed:
                have = 0  # the server ignored Range: start over
            with self.open_partial(part, "r+b" if resumed else "wb") as f:
                while f.tell() < have and (chunk := f.read(min(CHUNK, have - f.tell()))):
                    h.update(chunk)
                f.seek(have)
                n = have
                for chunk in r.iter_bytes(CHUNK):
                    self.client.backoff.check()
                    if n + len(chunk) > size:
                        raise Transient(f"server sent more than the {size} bytes listed")
                    f.write(chunk)
                    h.update(chunk)
                    n += len(chunk)
                    with self._cv:
                        self.downloaded_bytes += len(chunk)
                f.truncate(n)
            if n != size:
                raise Transient(f"connection ended at byte {n} of {size}")
            return tag + h.hexdigest()

    # -- the staging window ------------------------------------------------------------------------
    def _fits(self, size: int) -> bool:
        if not self._reserved:
            return True  # always allow one shard, or a shard larger than the window would deadlock
        if self.max_disk is not None and self.staged_bytes + size > self.max_disk:
            return False
        if self.lookahead is not None and len(self._reserved) + 1 > self.lookahead:
            return False
        return True

    def _reserve(self, name: str, size: int) -> None:
        self._reserved[name] = size
        self.staged_bytes += size
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)

    def _unreserve(self, name: str) -> None:
        size = self._reserved.pop(name, None)
        if size is not None:
            self.staged_bytes -= size

    def can_stage(self, names: Iterable[str]) -> bool:
        """Whether fetching all of ``names`` now keeps staging within the window (``_fits`` rules):
        shards already staged or downloading cost nothing."""
        with self._cv:
            new = [n for n in dict.fromkeys(names) if n not in self._reserved]
            if not new or not self._reserved:
                return True
            size = sum(self.entry(n).size for n in new)
            if self.max_disk is not None and self.staged_bytes + size > self.max_disk:
                return False
            if self.lookahead is not None and len(self._reserved) + len(new) > self.lookahead:
                return False
            return True

    def claim_work_dir(self) -> None:
        """One run stages into a work dir at a time: two would share partial downloads and delete
        shards the other still needs (the default work dir is per repo, so an a3 and a 950dt run of
        the same repo side by side would collide).  An advisory lock, released when the run ends."""
        self.lock.acquire()

    def prefetch(self, names: list[str]) -> None:
        self.claim_work_dir()
        for n in names:
            ent = self.entry(n)
            if self.max_disk is not None and ent.size > self.max_disk:
                raise HubError(f"{self.client.label(n)}: shard is {ent.size} bytes, larger than --max-disk "
                               f"({self.max_disk} bytes): raise it to at least the largest shard")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        need = sum(self.entry(n).size for n in names if not (self.work_dir / n).exists())
        window = self.max_disk if self.max_disk is not None else need
        free = shutil.disk_usage(self.work_dir).free
        if min(window, need) > free:
            raise HubError(f"{self.work_dir}: {free} bytes free, but staging needs up to {min(window, need)} "
                           "(lower --max-disk or free space)")
        with self._cv:
            self._plan = list(names)
            self._cursor = 0
            for n in names:
                if self._state.get(n) == "released":
                    del self._state[n]
            if not self.threads:
                for i in range(self.workers):
                    t = threading.Thread(target=self._worker, name=f"kq-hub-{i}", daemon=True)
                    t.start()
                    self.threads.append(t)
            self._cv.notify_all()

    def _worker(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._closed:
                        return
                    while self._cursor < len(self._plan) and self._plan[self._cursor] in self._state:
                        self._cursor += 1  # already taken by fetch() or another worker
                    if self._cursor < len(self._plan):
                        name = self._plan[self._cursor]
                        size = self.entry(name).size
                        if self._fits(size):
                            self._cursor += 1
                            self._state[name] = "downloading"
                            self._reserve(name, size)
                            break
                    self._cv.wait()
            self._stage(name)

    def _stage(self, name: str) -> None:
        try:
            self.download(name)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer in fetch()
            with self._cv:
                self._errors[name] = e
                self._state[name] = "failed"
                self._unreserve(name)
                self._cv.notify_all()
            return
        with self._cv:
            self._state[name] = "ready"
            self._cv.notify_all()

    def fetch(self, name: str) -> Path:
        self.claim_work_dir()
        size = self.entry(name).size
        with self._cv:
            st = self._state.get(name)
            own = st is None or st in ("released", "failed")
            if own:
                self._errors.pop(name, None)
                self._state[name] = "downloading"
                self._reserve(name, size)
            else:
                while self._state.get(name) == "downloading":
                    self._cv.wait()
                if name in self._errors:
                    raise self._errors[name]
                return self.work_dir / name
        self._stage(name)  # out of plan order (or no prefetch): download here, counted in the window
        with self._cv:
            if name in self._errors:
                raise self._errors[name]
        return self.work_dir / name

    def release(self, name: str) -> None:
        with self._cv:
            if self._state.get(name) == "downloading":
                return
            self._state[name] = "released"
            self._unreserve(name)
            self._cv.notify_all()
        if not self.keep_source:
            self.forget(name)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self.client.backoff.stop.set()
            self._cv.notify_all()
        for t in self.threads:
            t.join(timeout=30)
        self.threads = []
        self.lock.release()

