"""Where kimi-quant keeps what it can re-create: staged hub shards, this machine's codec rates,
compiled kernels.

Everything loaded from a cache is code or numbers that steer a run, so a cache directory must be
one nobody else can write: ``private_dir`` creates it 0700 and checks it (owned by this user, no
group/other access, no link in its path that someone else could re-point, every parent owned by
this user or root and, where others may write it, sticky) before anything is loaded from it or
written into it. A cache variable that names a shared directory (a 1777 scratch folder, a team
HF_HOME) gets a per-user folder inside it. Temporary files go through ``write_private``: a
``mkstemp`` name (O_EXCL | O_NOFOLLOW) in the checked directory, never a predictable one.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import stat
import tempfile
from pathlib import Path

from .errors import KimiQuantError

log = logging.getLogger(__name__)


class UnsafeCache(KimiQuantError):
    """A cache directory another user could write, or could re-point."""


def configured_cache_dir() -> Path:
    """$KIMI_QUANT_CACHE, else ``kimi-quant`` under $HF_HOME (where hub data already lives, usually the
    big disk), else under $XDG_CACHE_HOME, else ~/.cache/kimi-quant (not yet checked)."""
    if os.environ.get("KIMI_QUANT_CACHE"):
        return Path(os.environ["KIMI_QUANT_CACHE"]).expanduser()
    for var in ("HF_HOME", "XDG_CACHE_HOME"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser() / "kimi-quant"
    return Path.home() / ".cache" / "kimi-quant"


def cache_dir() -> Path:
    """The checked per-user cache directory (``configured_cache_dir``, made private; see the module doc)."""
    return private_dir(configured_cache_dir())


def _shared(st: os.stat_result) -> bool:
    """A directory others may create entries in."""
    return bool(st.st_mode & 0o022)


def _why_unsafe_parent(path: Path, st: os.stat_result) -> str | None:
    me = os.getuid()
    if st.st_uid not in (me, 0):
        return f"{path} belongs to uid {st.st_uid}"
    if _shared(st) and not st.st_mode & stat.S_ISVTX:
        return f"{path} is writable by others and not sticky (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _why_unsafe_above(path: Path) -> str | None:
    """Why the existing directories above ``path`` would let someone else replace it, or None."""
    me = os.getuid()
    existing = [p for p in reversed(path.parents) if os.path.lexists(p)]
    for parent in existing:
        st = os.lstat(parent)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (me, 0):
                return f"{parent} is a link owned by uid {st.st_uid}"
            continue  # its target is checked below, through the resolved path
        why = _why_unsafe_parent(parent, st)
        if why:
            return why
    if existing:
        last = existing[-1]
        real = Path(os.path.realpath(last))
        if real != last:
            for parent in [real, *real.parents]:
                why = _why_unsafe_parent(parent, os.lstat(parent))
                if why:
                    return why
    return None


def why_unsafe(path: Path) -> str | None:
    """Why ``path`` (an existing directory) cannot hold a private cache, or None: it must not be a link,
    be owned by this user with no group/other write, and every component above it must be a directory
    owned by this user or root (a link only if owned by them), sticky where others may write it."""
    path = Path(os.path.abspath(path))
    why = _why_unsafe_above(path)
    if why:
        return why
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}"
    if _shared(st):
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _make(path: Path) -> None:
    """Create ``path`` and missing parents, each 0700 (the umask cannot widen it)."""
    missing = []
    p = Path(os.path.abspath(path))
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass


def private_dir(path: Path, purpose: str = "cache") -> Path:
    """``path`` made and checked as a private directory (see ``why_unsafe``). A shared sticky directory
    (mode 1777, as /tmp) gives ``<path>/kimi-quant-<uid>`` instead; anything else unsafe is refused (one
    line naming why). An own directory with group/other bits is narrowed to 0700 first."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    why = _why_unsafe_above(path)
    if why:
        raise UnsafeCache(_refusal(purpose, path, why))
    try:
        _make(path)
    except OSError as e:
        raise UnsafeCache(f"{purpose} directory {path}: cannot create it ({e.strerror})") from None
    try:
        st = os.lstat(path)
    except OSError as e:
        raise UnsafeCache(f"{purpose} directory {path}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode) and _shared(st) and st.st_mode & stat.S_ISVTX:
        return private_dir(path / f"kimi-quant-{os.getuid()}", purpose)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)  # ours: narrow it (what others may have put in is checked by digest on load)
    why = why_unsafe(path)
    if why:
        raise UnsafeCache(_refusal(purpose, path, why))
    return path


def _refusal(purpose: str, path: Path, why: str) -> str:
    return (f"{purpose} directory {path} is not private ({why}): another local user could plant or redirect "
            "what kimi-quant loads from it or writes there; use a directory of your own (KIMI_QUANT_CACHE, "
            "NUMBA_CACHE_DIR, --work-dir)")


def write_private(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``path`` (in a checked directory) by a fresh ``mkstemp`` file renamed over it: no name
    another user could have placed a link at, and a reader sees the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


#: a cache file read back is small (rates, digests); a larger one, or one that is not a plain file, is foreign
MAX_CACHE_FILE = 1 << 20


def read_private(path: Path, limit: int = MAX_CACHE_FILE) -> bytes | None:
    """The bytes of a plain file of this user's in a cache directory, else None (missing, a link, a FIFO
    or device, someone else's, writable by others, or larger than ``limit``). Never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022
                or st.st_size > limit):
            return None
        chunks, n = [], 0
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
            n += len(chunk)
            if n > limit:
                return None
        return b"".join(chunks)
    finally:
        os.close(fd)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def cpu_id() -> str:
    """The kind of CPU this process runs on, for keys of what depends on it (compiled kernels, measured
    rates): vendor, model name and feature flags. The model name alone does not do: a VM may report
    "AMD EPYC" both with and without AVX-512, and a shared home on a mixed cluster meets both."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    first = text.split("\n\n", 1)[0]
    return "\n".join(ln for ln in first.splitlines() if ln.startswith(("model name", "flags", "vendor_id")))


def cpu_key() -> str:
    """A short digest of ``cpu_id()``."""
    return hashlib.blake2b(cpu_id().encode(), digest_size=8).hexdigest()
