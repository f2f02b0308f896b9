"""A checkpoint in a Hugging Face hub repo (or any server speaking its API: HF_ENDPOINT), streamed.

Planning reads small files and safetensors headers only (a header costs one or two small ranged
GETs, or the first bytes of one streamed response where the server ignores Range). Conversion asks
for shards one at a time; they are staged on local disk within a window (``hub_stage``). The
revision is resolved to a commit sha once; every request is pinned to it (``hub_client``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from ..errors import BadCheckpoint
from ..hub_http import Backoff, HubError
from .base import FileEntry, Source
from .hub_client import HubClient
from .hub_stage import Stager
from .safetensors import TensorInfo, parse_header, read_header

log = logging.getLogger(__name__)

RETRY_WAIT_CAP = 30.0  # seconds: the longest wait between two tries the source picks itself

__all__ = ["HubError", "HubSource", "default_work_dir"]


def default_work_dir(repo_id: str) -> Path:
    from ..cache import cache_dir

    return cache_dir() / "hub" / repo_id.replace("/", "--")


class HubSource(Source):
    """``repo_id`` at ``revision`` staged under ``work_dir`` (default: the cache's ``hub/<org>--<name>``),
    at most ``max_disk`` bytes and/or ``lookahead`` shards at once, by ``workers`` download threads;
    ``retries`` tries a request, waiting ``backoff`` seconds the first time, doubling."""

    stages = True  # shards arrive by download (base.Source's optional features)

    def __init__(self, repo_id: str, revision: str | None = None, work_dir=None, max_disk: int | None = None,
                 keep_source: bool = False, token: str | None = None, lookahead: int | None = None,
                 workers: int = 2, retries: int = 5, backoff: float = 1.0, endpoint: str | None = None,
                 repo_type: str = "model"):
        self.repo_id = repo_id
        self.id = repo_id
        self.client = HubClient(repo_id, revision, token, endpoint, repo_type,
                                Backoff(retries, backoff, RETRY_WAIT_CAP, closed_message=f"{repo_id}: source closed"))
        self.revision = self.client.revision
        self.requested_revision = self.client.requested_revision
        self.endpoint = self.client.endpoint
        self.work_dir = Path(work_dir) if work_dir is not None else default_work_dir(repo_id)
        self._files: dict[str, FileEntry] | None = None
        self._blob_ids: dict[str, str] = {}
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        self.stager = Stager(self.client, self.work_dir, self.entry, self._blob_ids.get, max_disk=max_disk,
                             lookahead=lookahead, keep_source=keep_source, workers=workers)
        self.max_disk = self.stager.max_disk

    # -- staging -----------------------------------------------------------------------------------
    @property
    def keep_source(self) -> bool:
        return self.stager.keep_source

    @property
    def staged_bytes(self) -> int:
        return self.stager.staged_bytes

    @property
    def peak_staged_bytes(self) -> int:
        return self.stager.peak_staged_bytes

    @property
    def downloaded_bytes(self) -> int:
        return self.stager.downloaded_bytes

    def can_stage(self, names: Iterable[str]) -> bool:
        """Whether fetching all of ``names`` now keeps staging within the window. The driver asks
        before starting a unit while others are in flight, and otherwise waits for them to finish and
        release their shards."""
        return self.stager.can_stage(names)

    # -- listing -----------------------------------------------------------------------------------
    def files(self) -> list[FileEntry]:
        if self._files is None:
            entries, blob_ids = self.client.listing()
            self._blob_ids.update(blob_ids)
            self._files = entries
        return list(self._files.values())

    def entry(self, name: str) -> FileEntry:
        self.files()
        try:
            return self._files[name]
        except KeyError:
            raise BadCheckpoint(f"{self.client.label(name)}: not in the repo at this revision") from None

    # -- small files and headers -------------------------------------------------------------------
    def read_bytes(self, name: str) -> bytes:
        ent = self.entry(name)
        local = self.work_dir / name
        if local.exists() and local.stat().st_size == ent.size and self.stager.verified(name):
            return local.read_bytes()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        want = self.stager.expected_digest(name)
        for round_ in (1, 2):
            try:
                path = self.client.download_small(name, self.work_dir, force=round_ > 1)
                data = path.read_bytes()
            except OSError as e:
                raise self.stager.os_error(e, name) from None
            # huggingface_hub checks an LFS file's sha256 but takes a small (git) file as it comes
            if want is None or self.stager.digest_bytes(data, name) == want:
                if want is not None:
                    self.stager.mark(name)
                return data
            log.warning("hub: %s: content does not match the hub's id %s (round %d); downloading again",
                        name, want, round_)
        path.unlink(missing_ok=True)
        raise HubError(f"{self.client.label(name)}: downloaded bytes do not match the hub's id twice (expected "
                       f"{want}): the hub copy or the connection is damaged")

    def header(self, name: str) -> dict[str, TensorInfo]:
        if name not in self._headers:
            ent = self.entry(name)
            if self.stager.verified(name, strict=False):
                self._headers[name] = read_header(self.work_dir / name)[0]
            else:
                prefix = self.client.header_prefix(name, ent.size)
                self._headers[name] = parse_header(prefix, ent.size, self.client.label(name))[0]
        return self._headers[name]

    # -- shards --------------------------------------------------------------------------------------
    def roots(self) -> list[Path]:
        return [self.work_dir]

    def prefetch(self, names: list[str]) -> None:
        self.stager.prefetch(names)

    def fetch(self, name: str) -> Path:
        return self.stager.fetch(name)

    def release(self, name: str) -> None:
        self.stager.release(name)

    def close(self) -> None:
        self.stager.close()
