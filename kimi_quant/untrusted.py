"""Input kimi-quant did not write (an index, a header, a hub listing, a journal) passes through here.

Names become paths only as relative names with no ``..``, no absolute part and no empty component,
so a hostile checkpoint cannot make kimi-quant read, write or delete outside the directories the
user named; JSON is parsed with every failure (nesting too deep included) turned into one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import BadCheckpoint


def unsafe_name(name) -> str | None:
    """Why ``name`` cannot be a path inside a directory (None when it can)."""
    if not isinstance(name, str) or not name:
        return "not a file name"
    if "\0" in name or "\\" in name:
        return "has a NUL or backslash"
    if name.startswith("/"):
        return "is an absolute path"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "has an empty, '.' or '..' component"
    return None


def inside(path: str | Path, root: str | Path) -> bool:
    """Whether ``path``, with every symlink resolved, lies in ``root`` (also resolved)."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip("/") + "/")


def unique_pairs(pairs):
    """``object_pairs_hook`` that refuses a repeated key (JSON's default keeps the last one silently)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k)
        out[k] = v
    return out


class DuplicateKey(ValueError):
    pass


def parse_json(data: bytes | str, where: str, unique_keys: bool = False):
    """JSON from a file we did not write: BadCheckpoint (one line) for invalid JSON, nesting too
    deep for the parser, and (``unique_keys``) an object with a repeated key."""
    try:
        return json.loads(data, object_pairs_hook=unique_pairs if unique_keys else None)
    except DuplicateKey as e:
        raise BadCheckpoint(f"{where}: key {e.args[0]!r} appears twice in one object") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadCheckpoint(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise BadCheckpoint(f"{where}: JSON nested too deeply to be a real file") from None
