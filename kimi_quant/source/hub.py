"""A checkpoint in a Hugging Face hub repo (or any server speaking its API: HF_ENDPOINT), streamed.

Planning reads small files and safetensors headers only (a header costs two small ranged GETs, or
the first bytes of one streamed response where the server ignores Range). Conversion asks for shards
one at a time: ``prefetch(order)`` starts background downloads in that order, bounded by a disk
window (``max_disk`` bytes and/or ``lookahead`` shards staged but not yet released); ``fetch`` blocks
until a shard is in ``work_dir``, complete and sha256-verified against the hub's LFS oid;
``release`` deletes the staged copy (unless ``keep_source``).

On disk, under ``work_dir``::

    <name>                      a verified shard (or a small file)
    .kq-hub/partial/<name>      a download in progress (resumed with HTTP Range when the server allows)
    .kq-hub/verified/<name>.json  {sha256, size, mtime_ns}: the file next to it was verified, so a
                                rerun does not download it again (it re-hashes it once before use)

The revision is resolved to a commit sha once; every request is pinned to it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import shutil
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

from ..cache import private_dir, write_private
from ..errors import BadCheckpoint, KimiQuantError
from ..lock import DirLock
from ..untrusted import unsafe_name
from .base import FileEntry, Source
from .safetensors import MAX_HEADER, TensorInfo, read_header

log = logging.getLogger(__name__)

CHUNK = 8 << 20
META_DIR = ".kq-hub"
DEFAULT_LOOKAHEAD = 2  # shards staged at once (the one being converted + one ahead) when no bound is given


class HubError(KimiQuantError):
    """A hub access failure explained in one line (auth, not found, network, disk)."""


class _Transient(Exception):
    def __init__(self, msg: str, retry_after: float | None = None):
        super().__init__(msg)
        self.retry_after = retry_after


def default_work_dir(repo_id: str) -> Path:
    from ..cache import cache_dir

    return cache_dir() / "hub" / repo_id.replace("/", "--")


def parse_header_prefix(prefix: bytes, size: int, label: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate a safetensors header from the first bytes of a file of ``size`` bytes.

    Reuses ``read_header`` (the single set of rules) on a sparse temporary file of the right size, so a
    header read over the network is held to exactly the checks a local shard gets; messages name ``label``.
    """
    with tempfile.TemporaryDirectory(prefix="kq-header-") as d:
        p = Path(d) / "h.safetensors"
        with open(p, "wb") as f:
            f.write(prefix[:size])
            f.truncate(size)  # sparse: costs no disk
        try:
            return read_header(p)
        except BadCheckpoint as e:
            raise BadCheckpoint(str(e).replace(str(p), label)) from None


class HubSource(Source):
    def __init__(self, repo_id: str, revision: str | None = None, work_dir=None, max_disk: int | None = None,
                 keep_source: bool = False, token: str | None = None, lookahead: int | None = None,
                 workers: int = 2, retries: int = 5, backoff: float = 1.0, endpoint: str | None = None,
                 repo_type: str = "model"):
        from huggingface_hub import HfApi, constants

        self.repo_id = repo_id
        self.id = repo_id
        self.repo_type = repo_type
        self.token = token
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        self.api = HfApi(endpoint=self.endpoint, token=token)
        self.work_dir = Path(work_dir) if work_dir is not None else default_work_dir(repo_id)
        self.keep_source = keep_source
        self.max_disk = int(max_disk) if max_disk is not None else None
        if lookahead is None and max_disk is None:
            lookahead = DEFAULT_LOOKAHEAD
        self.lookahead = lookahead
        self.workers = max(1, int(workers))
        self.retries = max(1, int(retries))
        self.backoff = backoff
        self.requested_revision = revision or "main"
        self._stop = threading.Event()  # before _resolve: its retries sleep on it
        self.revision = self._resolve(self.requested_revision)
        self._files: dict[str, FileEntry] | None = None
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        self._hashed: set[str] = set()  # staged files hashed by this process (see _verified)
        self._lock = DirLock(self.work_dir / META_DIR / "lock", lambda pid: HubError(
            f"{self.work_dir} is staging shards for another kimi-quant run (pid {pid}); wait for it to end, "
            "or give this run its own --work-dir"))  # taken once this run stages (see _claim_work_dir)
        # staging state, guarded by _cv
        self._cv = threading.Condition()
        self._plan: list[str] = []
        self._cursor = 0
        self._state: dict[str, str] = {}  # name -> "downloading" | "ready" | "released"
        self._errors: dict[str, BaseException] = {}
        self._reserved: dict[str, int] = {}  # staged (or being staged) and not released: name -> bytes
        self.staged_bytes = 0
        self.peak_staged_bytes = 0
        self.downloaded_bytes = 0  # bytes actually transferred in this process
        self._threads: list[threading.Thread] = []
        self._closed = False

    # -- resolution and listing -------------------------------------------------------------
    def _label(self, name: str | None = None) -> str:
        rev = (self.revision or self.requested_revision)[:12]
        return f"{self.repo_id}@{rev}" + (f"/{name}" if name else "")

    def _hub_error(self, e: BaseException, what: str) -> HubError:
        """Map a huggingface_hub / HTTP failure to one line."""
        from huggingface_hub import errors as hfe

        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(e, hfe.GatedRepoError):
            return HubError(f"{self.repo_id}: gated repo: accept its terms on the hub and set HF_TOKEN ({what})")
        if isinstance(e, hfe.RevisionNotFoundError):
            return HubError(f"{self.repo_id}: revision {self.requested_revision!r} not found")
        if isinstance(e, hfe.EntryNotFoundError):
            return HubError(f"{self._label()}: file not found: {what}")
        if isinstance(e, hfe.RepositoryNotFoundError):
            return HubError(f"{self.repo_id}: repo not found at {self.endpoint} (or private: set HF_TOKEN)")
        if status in (401, 403):
            return HubError(f"{self.repo_id}: access denied (HTTP {status}) for {what}: check HF_TOKEN "
                            "and that it may read this repo")
        if status == 404:
            return HubError(f"{self._label()}: not found (HTTP 404): {what}")
        return HubError(f"{self.repo_id}: hub request failed for {what}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}")

    def _call(self, fn, what: str):
        """Run a metadata call with retries on transient failures; map errors to one line."""
        from huggingface_hub import errors as hfe

        try:
            return self._call_raw(fn, what)
        except hfe.HfHubHTTPError as e:
            raise self._hub_error(e, what) from None

    def _resolve(self, revision: str) -> str:
        from huggingface_hub import errors as hfe

        try:
            info = self._call_raw(lambda: self.api.model_info(self.repo_id, revision=revision), f"revision {revision}")
        except hfe.RepositoryNotFoundError as e:
            if isinstance(e, hfe.GatedRepoError):
                raise self._hub_error(e, "model info") from None
            # some servers answer an unknown revision with RepoNotFound: tell the two apart
            if revision != "main":
                try:
                    self._call_raw(lambda: self.api.model_info(self.repo_id, revision="main"), "repo")
                except hfe.HfHubHTTPError:
                    pass
                else:
                    raise HubError(f"{self.repo_id}: revision {revision!r} not found") from None
            raise self._hub_error(e, "model info") from None
        except hfe.HfHubHTTPError as e:
            raise self._hub_error(e, f"revision {revision}") from None
        if not info.sha:
            raise HubError(f"{self.repo_id}: the hub did not resolve revision {revision!r} to a commit")
        return info.sha

    def _call_raw(self, fn, what: str):
        """Like _call but lets hub HTTP errors through (for callers that inspect them)."""
        import httpx2
        from huggingface_hub import errors as hfe

        for attempt in range(self.retries):
            try:
                return fn()
            except hfe.HfHubHTTPError as e:
                status = getattr(e.response, "status_code", None)
                if status in (429, 500, 502, 503, 504) and attempt + 1 < self.retries:
                    self._sleep(attempt, retry_after(e.response))
                    continue
                raise
            except (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError) as e:
                if attempt + 1 < self.retries:
                    self._sleep(attempt)
                    continue
                raise HubError(f"{self.repo_id}: cannot reach {self.endpoint} ({type(e).__name__}: {e})") from None
        raise AssertionError("unreachable")

    def files(self) -> list[FileEntry]:
        if self._files is None:
            from huggingface_hub.hf_api import RepoFile

            info = self._call(lambda: self.api.model_info(self.repo_id, revision=self.revision, files_metadata=True),
                              "file listing")
            sibs = info.siblings or []
            names = [s.rfilename for s in sibs]
            for n in names:  # before anything is written: huggingface_hub alone would guard only its own writes
                why = unsafe_name(n)
                if why:
                    raise HubError(f"{self._label()}: the repo lists a file named {n!r}, which {why}: refusing "
                                   "the repo (its files must stay inside the work dir)")
            entries: dict[str, FileEntry] = {}
            self._blob_ids: dict[str, str] = {}
            if sibs and all(s.size is not None for s in sibs):
                for s in sibs:
                    sha = s.lfs.sha256 if s.lfs is not None else None
                    entries[s.rfilename] = FileEntry(s.rfilename, int(s.size), sha)
                    if s.blob_id:
                        self._blob_ids[s.rfilename] = s.blob_id
            else:  # servers that omit sizes in model info (olah): ask paths-info, in batches
                for i in range(0, len(names), 500):
                    batch = names[i:i + 500]
                    for p in self._call(lambda: self.api.get_paths_info(self.repo_id, batch, revision=self.revision),
                                        "paths info"):
                        if isinstance(p, RepoFile):
                            sha = p.lfs.sha256 if p.lfs is not None else None
                            entries[p.path] = FileEntry(p.path, int(p.size), sha)
                            if p.blob_id:
                                self._blob_ids[p.path] = p.blob_id
                missing = [n for n in names if n not in entries]
                if missing:
                    raise HubError(f"{self._label()}: paths-info did not describe {len(missing)} listed files "
                                   f"(first: {missing[0]})")
            self._files = dict(sorted(entries.items()))
        return list(self._files.values())

    def entry(self, name: str) -> FileEntry:
        self.files()
        try:
            return self._files[name]
        except KeyError:
            raise BadCheckpoint(f"{self._label(name)}: not in the repo at this revision") from None

    # -- small files --------------------------------------------------------------------------
    def read_bytes(self, name: str) -> bytes:
        from huggingface_hub import hf_hub_download

        self.entry(name)
        local = self.work_dir / name
        if local.exists() and local.stat().st_size == self._files[name].size and self._verified(name):
            return local.read_bytes()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        want = self._expected_digest(name)
        for round_ in (1, 2):
            try:
                path = Path(self._call(lambda: hf_hub_download(
                    self.repo_id, name, revision=self.revision, local_dir=self.work_dir, endpoint=self.endpoint,
                    token=self.token, force_download=round_ > 1), name))
                data = path.read_bytes()
            except OSError as e:
                raise self._os_error(e, name) from None
            # huggingface_hub checks an LFS file's sha256 but takes a small (git) file as it comes
            if want is None or self._digest_bytes(data, name) == want:
                if want is not None:
                    self._mark(name)
                return data
            log.warning("hub: %s: content does not match the hub's id %s (round %d); downloading again",
                        name, want, round_)
        path.unlink(missing_ok=True)
        raise HubError(f"{self._label(name)}: downloaded bytes do not match the hub's id twice (expected {want}): "
                       "the hub copy or the connection is damaged")

    # -- headers -----------------------------------------------------------------------------
    def header(self, name: str) -> dict[str, TensorInfo]:
        if name in self._headers:
            return self._headers[name]
        ent = self.entry(name)
        local = self.work_dir / name
        if self._verified(name, strict=False):
            self._headers[name] = read_header(local)[0]
            return self._headers[name]
        prefix = self._read_prefix(name, ent.size)
        self._headers[name] = parse_header_prefix(prefix, ent.size, self._label(name))[0]
        return self._headers[name]

    def _read_prefix(self, name: str, size: int) -> bytes:
        """The first 8 + header-length bytes of ``name`` without downloading the rest.

        Ranged GETs where the server honours Range; otherwise the first bytes of a streamed full
        response, after which the connection is dropped.
        """
        if size < 8:
            return b""
        first = min(size, 1 << 20)  # most headers fit in the first MiB: usually one request
        head = self._get_range(name, 0, first)
        if len(head) < 8:
            return head
        (hlen,) = struct.unpack("<Q", head[:8])
        if hlen > MAX_HEADER or 8 + hlen > size or 8 + hlen <= len(head):
            return head  # complete, or invalid: parse_header_prefix decides
        return self._get_range(name, 0, 8 + hlen)

    def _get_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of ``name``; reads only what it needs even if the server sends the whole file."""
        import httpx2
        from huggingface_hub.utils import get_session

        for attempt in range(self.retries):
            try:
                with get_session().stream("GET", self._url(name), headers={**self._headers_http(),
                                                                          "Range": f"bytes={start}-{end - 1}"},
                                          follow_redirects=True, timeout=60) as r:
                    self._check_status(r, name)
                    skip = 0 if r.status_code == 206 else start
                    buf = bytearray()
                    for chunk in r.iter_bytes(1 << 16):
                        buf += chunk
                        if len(buf) >= skip + (end - start):
                            break  # leaving the block closes the response: the rest is never read
                    return bytes(buf[skip:skip + (end - start)])
            except _Transient as e:
                if attempt + 1 >= self.retries:
                    raise HubError(f"{self._label(name)}: {e} (gave up after {self.retries} tries)") from None
                self._sleep(attempt, e.retry_after)
            except (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError) as e:
                if attempt + 1 >= self.retries:
                    raise HubError(f"{self._label(name)}: network error reading the header: {e}") from None
                self._sleep(attempt)
        raise AssertionError("unreachable")

    # -- HTTP helpers -------------------------------------------------------------------------
    def _url(self, name: str) -> str:
        prefix = {"model": "", "dataset": "datasets/", "space": "spaces/"}[self.repo_type]
        return f"{self.endpoint}/{prefix}{self.repo_id}/resolve/{quote(self.revision, safe='')}/{quote(name)}"

    def _headers_http(self) -> dict[str, str]:
        from huggingface_hub.utils import build_hf_headers

        h = build_hf_headers(token=self.token)
        h["Accept-Encoding"] = "identity"
        return h

    def _check_status(self, r, name: str) -> None:
        s = r.status_code
        if s in (200, 206):
            return
        if s in (401, 403):
            code = r.headers.get("X-Error-Code", "")
            if code == "GatedRepo":
                raise HubError(f"{self.repo_id}: gated repo: accept its terms on the hub and set HF_TOKEN")
            raise HubError(f"{self._label(name)}: access denied (HTTP {s}): check HF_TOKEN and that it may read "
                           "this repo")
        if s == 404:
            raise HubError(f"{self._label(name)}: not found on the hub (HTTP 404)")
        if s == 416:
            raise _Transient("range not satisfiable (HTTP 416)")
        if s == 429 or s >= 500:
            raise _Transient(f"HTTP {s}", retry_after(r))
        raise HubError(f"{self._label(name)}: unexpected HTTP {s} from {self.endpoint}")

    def _sleep(self, attempt: int, retry_after: float | None = None) -> None:
        delay = retry_after if retry_after is not None else min(30.0, self.backoff * (2 ** attempt))
        delay *= 1.0 if retry_after is not None else (0.5 + random.random() / 2)
        log.info("hub: retrying in %.1fs", delay)
        if self._stop.wait(max(0.0, delay)):
            raise HubError(f"{self.repo_id}: source closed")

    def _os_error(self, e: OSError, name: str) -> KimiQuantError:
        if e.errno == errno.ENOSPC:
            free = shutil.disk_usage(self.work_dir).free if self.work_dir.exists() else 0
            return HubError(f"{self.work_dir}: disk full while downloading {name} ({free} bytes free): "
                            "free space or lower --max-disk")
        if isinstance(e, KimiQuantError):
            return e
        return HubError(f"{self._label(name)}: {type(e).__name__}: {e}")

    # -- verified staging ----------------------------------------------------------------------
    def _marker(self, name: str) -> Path:
        return self.work_dir / META_DIR / "verified" / (name + ".json")

    def _partial(self, name: str) -> Path:
        return self.work_dir / META_DIR / "partial" / name

    def _open_partial(self, part: Path, mode: str):
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

    def _verified(self, name: str, strict: bool = True) -> bool:
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
        if name in self._hashed:
            return True
        want = self._expected_digest(name)
        try:
            m = json.loads(self._marker(name).read_text())
            if m.get("digest") == want and m.get("size") == st.st_size and m.get("mtime_ns") == st.st_mtime_ns:
                if not strict:
                    return True
        except (OSError, ValueError):
            pass
        if want is None:
            return False
        if self._digest_file(path, name) == want:  # an earlier run's file, with or without its marker
            self._mark(name)
            return True
        return False

    def _expected_digest(self, name: str) -> str | None:
        ent = self.entry(name)
        if ent.sha256:
            return "sha256:" + ent.sha256
        blob = getattr(self, "_blob_ids", {}).get(name)
        return "gitsha1:" + blob if blob else None

    def _new_hasher(self, name: str):
        ent = self.entry(name)
        if ent.sha256:
            return hashlib.sha256(), "sha256:"
        h = hashlib.sha1()
        h.update(b"blob %d\0" % ent.size)
        return h, "gitsha1:"

    def _digest_bytes(self, data: bytes, name: str) -> str:
        h, tag = self._new_hasher(name)
        h.update(data)
        return tag + h.hexdigest()

    def _digest_file(self, path: Path, name: str) -> str:
        h, tag = self._new_hasher(name)
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        return tag + h.hexdigest()

    def _mark(self, name: str) -> None:
        """Record ``name`` as hashed and right, in this process and (the marker) for later runs."""
        self._hashed.add(name)
        st = (self.work_dir / name).stat()
        m = self._marker(name)
        private_dir(m.parent, "hub staging")
        write_private(m, json.dumps({"digest": self._expected_digest(name), "size": st.st_size,
                                     "mtime_ns": st.st_mtime_ns, "revision": self.revision}).encode())

    def _download(self, name: str) -> Path:
        """Download ``name`` into work_dir, resuming a partial file, and verify it; one re-download on mismatch."""
        final = self.work_dir / name
        if self._verified(name):
            return final
        ent = self.entry(name)
        want = self._expected_digest(name)
        for round_ in (1, 2):
            got = self._download_once(name, ent.size)
            if want is None or got == want:
                part = self._partial(name)
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(part, final)
                self._mark(name)
                return final
            self._partial(name).unlink(missing_ok=True)
            log.warning("hub: %s: checksum mismatch (round %d); downloading again from zero", name, round_)
        raise HubError(f"{self._label(name)}: downloaded bytes do not match the hub's checksum twice "
                       f"(expected {want}, got {got}): the hub copy is damaged")

    def _download_once(self, name: str, size: int) -> str:
        """Stream ``name`` into its partial file (resuming with Range), retrying transient errors; its digest."""
        import httpx2
        from huggingface_hub.utils import get_session

        part = self._partial(name)
        part.parent.mkdir(parents=True, exist_ok=True)
        last: BaseException | None = None
        for attempt in range(self.retries):
            if self._stop.is_set():
                raise HubError(f"{self.repo_id}: source closed")
            have = part.lstat().st_size if part.exists() and not part.is_symlink() else 0
            if have > size or part.is_symlink():
                part.unlink()
                have = 0
            h, tag = self._new_hasher(name)
            try:
                if have == size:
                    with self._open_partial(part, "rb") as f:
                        while chunk := f.read(CHUNK):
                            h.update(chunk)
                    return tag + h.hexdigest()
                headers = self._headers_http()
                if have:
                    headers["Range"] = f"bytes={have}-"
                with get_session().stream("GET", self._url(name), headers=headers, follow_redirects=True,
                                          timeout=httpx2.Timeout(60.0, connect=30.0)) as r:
                    self._check_status(r, name)
                    if have and r.status_code == 206 and r.headers.get("Content-Range", "").startswith(
                            f"bytes {have}-"):
                        mode = "r+b"
                    else:
                        mode, have = "wb", 0  # the server ignored Range: start over
                    with self._open_partial(part, mode) as f:
                        if have:
                            while f.tell() < have and (chunk := f.read(min(CHUNK, have - f.tell()))):
                                h.update(chunk)
                            f.seek(have)
                        n = have
                        for chunk in r.iter_bytes(CHUNK):
                            if self._stop.is_set():
                                raise HubError(f"{self.repo_id}: source closed")
                            if n + len(chunk) > size:
                                raise _Transient(f"server sent more than the {size} bytes listed")
                            f.write(chunk)
                            h.update(chunk)
                            n += len(chunk)
                            with self._cv:
                                self.downloaded_bytes += len(chunk)
                        f.truncate(n)
                    if n != size:
                        raise _Transient(f"connection ended at byte {n} of {size}")
                    return tag + h.hexdigest()
            except _Transient as e:
                last = e
                if attempt + 1 < self.retries:
                    self._sleep(attempt, e.retry_after)
            except (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError) as e:
                last = e
                if attempt + 1 < self.retries:
                    self._sleep(attempt)
            except OSError as e:
                raise self._os_error(e, name) from None
        raise HubError(f"{self._label(name)}: download failed after {self.retries} tries: {last}")

    # -- the staging window ----------------------------------------------------------------------
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

    def can_stage(self, names) -> bool:
        """Whether fetching all of ``names`` now keeps staging within the window (``_fits`` rules):
        shards already staged or downloading cost nothing. The driver asks before starting a unit while
        others are in flight, and otherwise waits for them to finish and release their shards."""
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

    def _claim_work_dir(self) -> None:
        """One run stages into a work dir at a time: two would share partial downloads and delete
        shards the other still needs (the default work dir is per repo, so an a3 and a 950dt run of
        the same repo side by side would collide).  An advisory lock, released when the run ends."""
        self._lock.acquire()

    def prefetch(self, names: list[str]) -> None:
        self._claim_work_dir()
        for n in names:
            ent = self.entry(n)
            if self.max_disk is not None and ent.size > self.max_disk:
                raise HubError(f"{self._label(n)}: shard is {ent.size} bytes, larger than --max-disk "
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
            if not self._threads:
                for i in range(self.workers):
                    t = threading.Thread(target=self._worker, name=f"kq-hub-{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
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
            self._download(name)
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

    def roots(self) -> list[Path]:
        return [self.work_dir]

    def fetch(self, name: str) -> Path:
        self._claim_work_dir()
        self.entry(name)
        with self._cv:
            st = self._state.get(name)
            if st is None or st == "released" or st == "failed":
                self._errors.pop(name, None)
                self._state[name] = "downloading"
                self._reserve(name, self.entry(name).size)
                own = True
            else:
                own = False
            if not own:
                while self._state.get(name) == "downloading":
                    self._cv.wait()
                if name in self._errors:
                    err = self._errors[name]
                    raise err
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
            self._hashed.discard(name)
            (self.work_dir / name).unlink(missing_ok=True)
            self._marker(name).unlink(missing_ok=True)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._stop.set()
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []
        self._lock.release()


#: longest wait a server's Retry-After can impose before a retry (a longer ask is capped, with a message)
MAX_RETRY_AFTER = 300.0


def retry_after(response) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), when a server sent one;
    at most MAX_RETRY_AFTER (an absurd ask such as ``inf`` or ``1e11`` is capped, with a warning)."""
    try:
        v = response.headers.get("Retry-After")
    except AttributeError:
        return None
    if v is None:
        return None
    try:
        secs = float(v)
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            secs = parsedate_to_datetime(v).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError):
            return None
    if secs != secs:  # NaN
        return None
    if secs > MAX_RETRY_AFTER:
        log.warning("kimi-quant: the server asked to wait %s s before retrying (Retry-After: %s); waiting %.0f s",
                    f"{secs:.3g}", str(v)[:40], MAX_RETRY_AFTER)
        return MAX_RETRY_AFTER
    return max(0.0, secs)
