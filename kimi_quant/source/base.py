"""The Source interface: what the planner and the executors need from a checkpoint's origin.

Planning needs only small files and safetensors headers. Conversion asks for one shard at a time
with ``fetch`` (which blocks until the shard is local and verified) and says when it is done with it
with ``release`` (a hub source may then delete its staged copy). ``prefetch`` announces the order in
which shards will be needed so a hub source can download ahead within its disk window.

``Source`` is a ``typing.Protocol``: the features only some sources have (a local root, a staging
directory and its window) are declared on it with the value a source without them has, so callers
read ``source.max_disk`` rather than probe for it.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import BadCheckpoint, KimiQuantError
from ..output_files import DESCRIPTION, PROVENANCE
from ..untrusted import parse_json, unsafe_name, vetted_identity
from .safetensors import TensorInfo

WEIGHT_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class FileEntry:
    name: str  # path relative to the repo root
    size: int
    sha256: str | None = None  # known for hub LFS files; None for local until hashed
    mtime_ns: int | None = None  # local files: with size and ctime, tells whether a recorded hash is still valid
    ctime_ns: int | None = None  # changes on every write, even one that restores the mtime (cp -p, rsync -a)

    @property
    def stamp(self) -> str:
        return f"{self.size}:{self.mtime_ns}:{self.ctime_ns}"

    @property
    def identity(self) -> str:
        """What must not change for an output made from this file to stay valid: size, mtime and
        ctime of a local file (any rewrite changes the ctime), the sha256 of a hub file (pinned)."""
        return self.stamp if self.mtime_ns is not None or not self.sha256 else f"sha256:{self.sha256}"


class Source(Protocol):
    """What the planner and the executors use of a checkpoint's origin. Implementations subclass it
    (``LocalSource``, ``HubSource``) and inherit the defaults of the features they lack."""

    id: str = ""
    revision: str | None = None  # a commit sha for hub sources

    # -- optional features: a source without one keeps the default ------------------------------
    #: the directory of a local checkpoint (an output must not overlap it)
    root: Path | None = None
    #: where shards are staged on their way in (an output must not overlap it either)
    work_dir: Path | None = None
    #: most bytes of shards staged at once (--max-disk); None: no byte bound
    max_disk: int | None = None
    #: shards arrive by download: the first take a while before any work can start
    stages: bool = False

    @property
    def peak_staged_bytes(self) -> int | None:
        """Most bytes of shards staged at once so far; None for a source that stages nothing."""
        return None

    def can_stage(self, names: Iterable[str]) -> bool:
        """Whether fetching all of ``names`` now keeps staging within its window; a source that stages
        nothing always can."""
        return True

    # -- every source ----------------------------------------------------------------------------
    @abstractmethod
    def files(self) -> list[FileEntry]:
        """Every file of the checkpoint."""

    @abstractmethod
    def read_bytes(self, name: str) -> bytes:
        """A small file (config.json, the index, tokenizer files)."""

    @abstractmethod
    def header(self, name: str) -> dict[str, TensorInfo]:
        """The validated safetensors header of shard ``name`` (offsets absolute in the file)."""

    @abstractmethod
    def fetch(self, name: str) -> Path:
        """A local path to shard ``name``, complete and verified; blocks until it is."""

    @abstractmethod
    def roots(self) -> list[Path]:
        """The directories a fetched shard may lie in (links resolved)."""

    def fetch_vetted(self, name: str) -> tuple[Path, str]:
        """``fetch(name)`` and the identity (``untrusted.file_identity``) of the file that path opens,
        taken from an open descriptor checked to lie in ``roots()``: a worker that opens the path
        later refuses any other file (a name re-pointed after this check)."""
        path = self.fetch(name)
        return path, vetted_identity(path, self.roots())

    def release(self, name: str) -> None:
        """Every output that needs ``name`` is written; a staging copy may be deleted."""

    def prefetch(self, names: list[str]) -> None:
        """Shards will be fetched in this order; a hub source may start downloading ahead."""

    def close(self) -> None:
        pass

    # -- derived ---------------------------------------------------------------------------
    def read_json(self, name: str, unique_keys: bool = False):
        """``name`` parsed as JSON; one line for anything that is not (including nesting too deep to
        parse). ``unique_keys``: an object that repeats a key is refused, not silently last-wins."""
        return parse_json(self.read_bytes(name), f"{self.id}/{name}", unique_keys)

    def weight_map(self) -> dict[str, str]:
        """tensor name -> shard file, from the index (or the single ``model.safetensors``).

        Every shard the index names must be a plain relative name of a file in the checkpoint: an
        index pointing at ``../elsewhere`` or ``/abs/path`` is refused before anything is read."""
        names = {f.name for f in self.files()}
        if WEIGHT_INDEX in names:
            where = f"{self.id}/{WEIGHT_INDEX}"
            index = self.read_json(WEIGHT_INDEX, unique_keys=True)
            if not isinstance(index, dict):
                raise BadCheckpoint(f"{where}: expected a JSON object, got a {type(index).__name__}")
            wm = index.get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise BadCheckpoint(f"{where}: has no weight_map")
            for tensor, shard in wm.items():
                if not isinstance(shard, str):
                    raise BadCheckpoint(f"{where}: tensor {tensor!r} maps to {shard!r}, not a file name")
                why = unsafe_name(shard)
                if why:
                    raise BadCheckpoint(f"{where}: tensor {tensor!r} maps to {shard!r}, which {why}: "
                                        "the index may only name files inside the checkpoint")
                if shard not in names:
                    raise BadCheckpoint(f"{where}: tensor {tensor!r} maps to {shard!r}, which is not a file of "
                                        "the checkpoint (missing shard?)")
            return dict(wm)
        if SINGLE_FILE in names:
            return {t: SINGLE_FILE for t in self.header(SINGLE_FILE)}
        if DESCRIPTION in names:
            raise BadCheckpoint(f"{self.id}: already quantized ({self._quantized_for()}ascendV1, {DESCRIPTION}): "
                                "convert the checkpoint it was made from (BF16, or the MXFP4 release)")
        raise BadCheckpoint(f"{self.id}: no {WEIGHT_INDEX} and no {SINGLE_FILE}: not a safetensors checkpoint")

    def _quantized_for(self) -> str:
        """'by kimi-quant for a3, ' when an ascendV1 output's provenance says so (else nothing)."""
        try:
            provenance = self.read_json(PROVENANCE)
        except (KimiQuantError, OSError):  # a missing or unreadable provenance only shortens the message
            return ""
        target = provenance.get("target") if isinstance(provenance, dict) else None
        return f"by kimi-quant for {target}, " if isinstance(target, str) and len(target) < 40 else ""
