"""The hub side of a hub source: one repo at one commit, its file list, small files and byte ranges.

Built on huggingface_hub (``HfApi`` for metadata, ``hf_hub_download`` for small files, its session
and error reading for ranged GETs, see ``hub_http``); every request is pinned to the commit the
revision resolved to, and every failure is one line naming the repo (and file).
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from huggingface_hub import HfApi, constants, hf_hub_download, hf_hub_url
from huggingface_hub import errors as hfe
from huggingface_hub.hf_api import RepoFile

from ..hub_http import (NETWORK_ERRORS, Backoff, HubError, Transient, get_session, hub_headers, raise_for_status,
                        refusal, status_of, transient)
from ..untrusted import unsafe_name
from .base import FileEntry
from .safetensors import MAX_HEADER

log = logging.getLogger(__name__)

T = TypeVar("T")
FIRST_READ = 1 << 20  # most safetensors headers fit in the first MiB: usually one request
PATHS_INFO_BATCH = 500
READ_TIMEOUT = 60.0


class HubClient:
    """``repo_id`` at ``revision`` (a branch, tag or sha; resolved to a commit sha at once) on ``endpoint``
    (default HF_ENDPOINT, else huggingface_hub's). ``backoff`` paces retries; setting its ``stop``
    event ends a wait or a transfer with ``hub_http.Closed``."""

    def __init__(self, repo_id: str, revision: str | None, token: str | None, endpoint: str | None,
                 repo_type: str, backoff: Backoff):
        self.repo_id = repo_id
        self.repo_type = repo_type
        self.token = token
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        self.api = HfApi(endpoint=self.endpoint, token=token)
        self.backoff = backoff
        self.requested_revision = revision or "main"
        self.revision: str | None = None
        self.revision = self._resolve(self.requested_revision)

    def label(self, name: str | None = None) -> str:
        rev = (self.revision or self.requested_revision)[:12]
        return f"{self.repo_id}@{rev}" + (f"/{name}" if name else "")

    # -- errors ------------------------------------------------------------------------------------
    def error(self, e: BaseException, what: str) -> HubError:
        """A failed metadata call (or small-file download) in one line."""
        kind = refusal(e)
        status = status_of(e)
        if kind == "gated":
            return HubError(f"{self.repo_id}: gated repo: accept its terms on the hub and set HF_TOKEN ({what})")
        if kind == "revision":
            return HubError(f"{self.repo_id}: revision {self.requested_revision!r} not found")
        if kind == "entry":
            return HubError(f"{self.label()}: file not found: {what}")
        if kind == "repo":
            return HubError(f"{self.repo_id}: repo not found at {self.endpoint} (or private: set HF_TOKEN)")
        if kind == "denied":
            return HubError(f"{self.repo_id}: access denied (HTTP {status}) for {what}: check HF_TOKEN "
                            "and that it may read this repo")
        if kind == "missing":
            return HubError(f"{self.label()}: not found (HTTP 404): {what}")
        return HubError(f"{self.repo_id}: hub request failed for {what}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}")

    def read_error(self, e: BaseException, name: str) -> HubError:
        """A failed GET of file ``name`` in one line (gated, denied, missing, or an answer never expected)."""
        status = status_of(e)
        if refusal(e) == "gated":
            return HubError(f"{self.repo_id}: gated repo: accept its terms on the hub and set HF_TOKEN")
        if status in (401, 403):
            return HubError(f"{self.label(name)}: access denied (HTTP {status}): check HF_TOKEN and that it may "
                            "read this repo")
        if status == 404:
            return HubError(f"{self.label(name)}: not found on the hub (HTTP 404)")
        return HubError(f"{self.label(name)}: unexpected HTTP {status} from {self.endpoint}")

    def check_read(self, response, name: str) -> None:
        """Return if ``response`` carries the bytes (200, or 206 for a range); raise ``Transient`` when
        another try may succeed, else HubError."""
        if response.status_code in (200, 206):
            return
        try:
            raise_for_status(response)
        except hfe.HfHubHTTPError as e:
            raise self.read_error(e, name) from None
        raise HubError(f"{self.label(name)}: unexpected HTTP {response.status_code} from {self.endpoint}")

    # -- metadata ----------------------------------------------------------------------------------
    def call(self, fn: Callable[[], T], what: str) -> T:
        """A metadata call, retried while it fails transiently; any other failure in one line."""
        try:
            return self.call_raw(fn, what)
        except hfe.HfHubHTTPError as e:
            raise self.error(e, what) from None

    def call_raw(self, fn: Callable[[], T], what: str) -> T:
        """Like ``call`` but lets the hub's HTTP errors through (for callers that tell them apart)."""
        for attempt in range(self.backoff.tries):
            try:
                return fn()
            except (hfe.HfHubHTTPError, *NETWORK_ERRORS) as e:
                again = transient(e)
                if again is None or attempt + 1 >= self.backoff.tries:
                    if isinstance(e, NETWORK_ERRORS):
                        raise HubError(f"{self.repo_id}: cannot reach {self.endpoint} ({type(e).__name__}: {e})") \
                            from None
                    raise
                delay = self.backoff.delay(attempt, again.retry_after)
                log.info("hub: %s: %s; retrying in %.1fs", what, again, delay)
                self.backoff.wait(attempt, delay)
        raise AssertionError("unreachable")

    def _resolve(self, revision: str) -> str:
        def info(rev: str):
            return self.api.model_info(self.repo_id, revision=rev)

        try:
            found = self.call_raw(lambda: info(revision), f"revision {revision}")
        except hfe.RepositoryNotFoundError as e:
            if isinstance(e, hfe.GatedRepoError):
                raise self.error(e, "model info") from None
            # some servers answer an unknown revision with RepoNotFound: tell the two apart
            if revision != "main":
                try:
                    self.call_raw(lambda: info("main"), "repo")
                except hfe.HfHubHTTPError:
                    pass
                else:
                    raise HubError(f"{self.repo_id}: revision {revision!r} not found") from None
            raise self.error(e, "model info") from None
        except hfe.HfHubHTTPError as e:
            raise self.error(e, f"revision {revision}") from None
        if not found.sha:
            raise HubError(f"{self.repo_id}: the hub did not resolve revision {revision!r} to a commit")
        return found.sha

    def listing(self) -> tuple[dict[str, FileEntry], dict[str, str]]:
        """Every file at the commit (name -> entry, sorted) and the git blob id of those that have one.

        A name that would lead out of a directory is refused before anything is written: huggingface_hub
        alone would guard only its own writes."""
        info = self.call(lambda: self.api.model_info(self.repo_id, revision=self.revision, files_metadata=True),
                         "file listing")
        siblings = info.siblings or []
        names = [s.rfilename for s in siblings]
        for n in names:
            why = unsafe_name(n)
            if why:
                raise HubError(f"{self.label()}: the repo lists a file named {n!r}, which {why}: refusing "
                               "the repo (its files must stay inside the work dir)")
        entries: dict[str, FileEntry] = {}
        blob_ids: dict[str, str] = {}

        def add(path: str, size: int, lfs, blob_id: str | None) -> None:
            entries[path] = FileEntry(path, int(size), lfs.sha256 if lfs is not None else None)
            if blob_id:
                blob_ids[path] = blob_id

        if siblings and all(s.size is not None for s in siblings):
            for s in siblings:
                add(s.rfilename, s.size, s.lfs, s.blob_id)
        else:  # servers that omit sizes in model info (olah): ask paths-info, in batches
            for i in range(0, len(names), PATHS_INFO_BATCH):
                batch = names[i:i + PATHS_INFO_BATCH]
                for p in self.call(lambda: self.api.get_paths_info(self.repo_id, batch, revision=self.revision),
                                   "paths info"):
                    if isinstance(p, RepoFile):
                        add(p.path, p.size, p.lfs, p.blob_id)
            missing = [n for n in names if n not in entries]
            if missing:
                raise HubError(f"{self.label()}: paths-info did not describe {len(missing)} listed files "
                               f"(first: {missing[0]})")
        return dict(sorted(entries.items())), blob_ids

    def download_small(self, name: str, local_dir: Path, force: bool) -> Path:
        """``name`` through huggingface_hub into ``local_dir`` (it checks an LFS file's sha256, not a git file's)."""
        return Path(self.call(lambda: hf_hub_download(
            self.repo_id, name, revision=self.revision, local_dir=local_dir, endpoint=self.endpoint,
            token=self.token, force_download=force), name))

    # -- byte ranges -------------------------------------------------------------------------------
    def url(self, name: str) -> str:
        return hf_hub_url(self.repo_id, name, repo_type=self.repo_type, revision=self.revision,
                          endpoint=self.endpoint)

    @contextmanager
    def stream(self, name: str, start: int = 0, end: int | None = None, timeout=READ_TIMEOUT) -> Iterator:
        """A streamed GET of ``name`` from byte ``start`` (to ``end``, exclusive): 206 where the server
        honours the range, 200 (the whole file) where it does not; Transient or HubError otherwise."""
        headers = hub_headers(self.token)
        if start or end is not None:
            headers["Range"] = f"bytes={start}-" + (str(end - 1) if end is not None else "")
        with get_session().stream("GET", self.url(name), headers=headers, follow_redirects=True,
                                  timeout=timeout) as r:
            self.check_read(r, name)
            yield r

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of ``name``; reads only what it needs even if the server sends the whole file."""
        for attempt in range(self.backoff.tries):
            try:
                with self.stream(name, start, end) as r:
                    skip = 0 if r.status_code == 206 else start
                    buf = bytearray()
                    for chunk in r.iter_bytes(1 << 16):
                        buf += chunk
                        if len(buf) >= skip + (end - start):
                            break  # leaving the block closes the response: the rest is never read
                    return bytes(buf[skip:skip + (end - start)])
            except Transient as e:
                if attempt + 1 >= self.backoff.tries:
                    raise HubError(f"{self.label(name)}: {e} (gave up after {self.backoff.tries} tries)") from None
                self.backoff.wait(attempt, e.retry_after)
            except NETWORK_ERRORS as e:
                if attempt + 1 >= self.backoff.tries:
                    raise HubError(f"{self.label(name)}: network error reading the header: {e}") from None
                self.backoff.wait(attempt)
        raise AssertionError("unreachable")

    def header_prefix(self, name: str, size: int) -> bytes:
        """The first 8 + header-length bytes of safetensors file ``name`` (``size`` bytes) without the rest:
        one ranged GET when the header fits the first MiB, else a second for exactly the header."""
        if size < 8:
            return b""
        head = self.read_range(name, 0, min(size, FIRST_READ))
        if len(head) < 8:
            return head
        (hlen,) = struct.unpack("<Q", head[:8])
        if hlen > MAX_HEADER or 8 + hlen > size or 8 + hlen <= len(head):
            return head  # complete, or invalid: the parser says which
        return self.read_range(name, 0, 8 + hlen)
