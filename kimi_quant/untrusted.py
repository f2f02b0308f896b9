"""Input kimi-quant did not write (an index, a header, a hub listing, a journal) passes through here.

Names become paths only as relative names with no ``..``, no absolute part and no empty component,
so a hostile checkpoint cannot make kimi-quant read, write or delete outside the directories the
user named; JSON is parsed with every failure (nesting too deep included) turned into one line."""

from __future__ import annotations

import json
import os
import stat
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


def file_identity(st: os.stat_result) -> str:
    """Which file an open descriptor is (its ``fstat``): inode, size, mtime and ctime. Another file
    put under the same name (a swap, a link re-pointed) differs in its inode; the same file
    rewritten in place differs in its ctime. Stable across nodes mounting one shared filesystem."""
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def check_identity(fd: int, path: str | Path, expected: str | None) -> None:
    """Refuse the open file ``fd`` (named ``path``) unless it is the file whose identity was
    ``expected`` (None: nothing to check)."""
    if expected is not None and file_identity(os.fstat(fd)) != expected:
        raise BadCheckpoint(f"{path}: is not the file that was checked when this work was scheduled (replaced or "
                            "re-pointed since); refusing to read it")


def vetted_identity(path: str | Path, roots: list[Path]) -> str:
    """``file_identity`` of the file ``path`` opens, refused (BadCheckpoint) unless that very file, as
    opened, lies in one of ``roots``. Checking the name and then opening it leaves a window in
    which the name can be pointed elsewhere; the descriptor's own path cannot be."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise BadCheckpoint(f"{path}: not found") from None
    try:
        real = os.path.realpath(f"/proc/self/fd/{fd}") if os.path.isdir("/proc/self/fd") else os.path.realpath(path)
        if not any(inside(real, r) for r in roots):
            raise BadCheckpoint(f"{path}: opens {real}, outside {', '.join(map(str, roots))}: refusing to read it")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadCheckpoint(f"{path}: not a regular file")
        return file_identity(st)
    finally:
        os.close(fd)


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
