"""The JSON records an output keeps beside its shards (provenance, validation report, description,
index), read where a missing or damaged record means "none": one reader for all of them.
``verify`` reads the same files strictly, naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

from ..output_files import PROVENANCE


def read_record(path: Path) -> dict | None:
    """The JSON object in ``path``; None when it is absent, unreadable, not JSON or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def read_provenance(out_dir: Path) -> dict:
    """The output's provenance ({} when it has none that reads)."""
    return read_record(Path(out_dir) / PROVENANCE) or {}


def recorded(out_dir: Path, key: str) -> dict | None:
    """What the provenance records under ``key`` when that is an object (e.g. ``calibration``,
    ``source_packing``, ``validation``), else None."""
    value = read_provenance(out_dir).get(key)
    return value if isinstance(value, dict) else None
