"""Where numba keeps its JIT cache (a pickled index and machine code, loaded on import of the kernels):
only in a directory checked to be private, set before numba is imported (``numba_cache_dir``)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from ..cache import UnsafeCache, cache_dir, private_dir, why_unsafe

log = logging.getLogger(__name__)
_HERE = Path(__file__).resolve().parent


_warned: set[str] = set()


def warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning("kimi-quant: warning: %s", msg)


def _in_tree_usable(here: Path) -> bool:
    """``quant/__pycache__`` holds the caches only while it is as private as the source beside it."""
    if not os.access(_HERE, os.W_OK) or why_unsafe(_HERE) is not None:
        return False
    try:
        here.mkdir(mode=0o755, exist_ok=True)
    except OSError:
        return False
    return why_unsafe(here) is None and os.access(here, os.W_OK)


def numba_cache_dir() -> Path | None:
    """The checked directory numba's JIT cache (pickled index and machine code) lives in, with
    NUMBA_CACHE_DIR set to it for numba and for the workers; None: numba's own place beside the
    source (``quant/__pycache__``), which is private. A NUMBA_CACHE_DIR that is not private is
    replaced by ``<cache>/numba``, with one warning. Call before numba is imported."""
    env = os.environ.get("NUMBA_CACHE_DIR")
    if env:
        try:
            d = private_dir(Path(env), "NUMBA_CACHE_DIR")
        except UnsafeCache as e:
            d = private_dir(cache_dir() / "numba", "numba cache")
            warn_once(f"{e}; using {d} instead")
    elif _in_tree_usable(_HERE / "__pycache__"):
        return None
    else:
        d = private_dir(cache_dir() / "numba", "numba cache")
    if os.environ.get("NUMBA_CACHE_DIR") != str(d):
        os.environ["NUMBA_CACHE_DIR"] = str(d)
    config = sys.modules.get("numba.core.config")
    if config is not None and getattr(config, "CACHE_DIR", None) != str(d):
        config.CACHE_DIR = str(d)  # numba was imported first: it reads the directory at each lookup
    return d
