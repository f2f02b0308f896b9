"""Atomic file replacement: temporary name, fsync, rename, fsync of the directory.

A reader (or a resumed run) therefore sees either the old file or the complete new one.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from ..errors import KimiQuantError


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_full(path: str | Path, e: OSError) -> KimiQuantError:
    return KimiQuantError(f"{path}: no space left on device; free space and re-run the same command to resume")


def write_atomic(path: str | Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise disk_full(path, e) from None
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())
