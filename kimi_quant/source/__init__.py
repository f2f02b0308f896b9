"""Where the BF16 checkpoint comes from: a local directory or a hub repo (see base.Source)."""

import os
import re
from pathlib import Path

from ..errors import BadCheckpoint
from .base import FileEntry, Source
from .local import LocalSource

__all__ = ["FileEntry", "LocalSource", "Source", "open_source"]


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def open_source(spec: str, revision: str | None = None, work_dir=None, **kwargs) -> Source:
    """A local directory if ``spec`` is one, else a hub repo id (``org/name``).

    A spec that is neither says both readings in one line: 'no such directory; as a hub id: ...'
    (at once when HF_HUB_OFFLINE is set, instead of waiting on the network)."""
    if Path(spec).expanduser().exists():
        return LocalSource(Path(spec).expanduser())
    if not _REPO_ID.fullmatch(spec) or ".." in spec:
        raise BadCheckpoint(f"{spec}: no such directory, and not a hub repo id (ORG/NAME)")
    if hub_offline():
        raise BadCheckpoint(f"{spec}: no such directory; as a hub id: not looked up, HF_HUB_OFFLINE is set")
    from .hub import HubError, HubSource  # imported lazily: the network client is not needed for local work

    try:
        return HubSource(spec, revision=revision, work_dir=work_dir, **kwargs)
    except HubError as e:
        why = str(e).removeprefix(f"{spec}: ")
        raise HubError(f"{spec}: no such directory; as a hub id: {why}") from None
