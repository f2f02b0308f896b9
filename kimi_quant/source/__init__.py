"""Where the BF16 checkpoint comes from: a local directory or a hub repo (see base.Source)."""

from .base import FileEntry, Source
from .local import LocalSource

__all__ = ["FileEntry", "LocalSource", "Source", "open_source"]


def open_source(spec: str, revision: str | None = None, work_dir=None, **kwargs) -> Source:
    """A local directory if ``spec`` is one, else a hub repo id (``org/name``)."""
    from pathlib import Path

    if Path(spec).expanduser().exists():
        return LocalSource(Path(spec).expanduser())
    from .hub import HubSource  # imported lazily: the network client is not needed for local work

    return HubSource(spec, revision=revision, work_dir=work_dir, **kwargs)
