"""Where the BF16 checkpoint comes from: a local directory or a hub repo (see base.Source)."""

import re
from pathlib import Path

from ..errors import BadCheckpoint
from .base import FileEntry, Source
from .local import LocalSource

__all__ = ["FileEntry", "LocalSource", "Source", "open_source"]


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def open_source(spec: str, revision: str | None = None, work_dir=None, **kwargs) -> Source:
    """A local directory if ``spec`` is one, else a hub repo id (``org/name``)."""
    if Path(spec).expanduser().exists():
        return LocalSource(Path(spec).expanduser())
    if not _REPO_ID.fullmatch(spec) or ".." in spec:
        raise BadCheckpoint(f"{spec}: no such directory, and not a hub repo id (ORG/NAME)")
    from .hub import HubSource  # imported lazily: the network client is not needed for local work

    return HubSource(spec, revision=revision, work_dir=work_dir, **kwargs)
