"""Where kimi-quant keeps what it can re-create: staged hub shards, this machine's codec rates."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$KIMI_QUANT_CACHE, else ``kimi-quant`` under $HF_HOME (where hub data already lives, usually the
    big disk), else under $XDG_CACHE_HOME, else ~/.cache/kimi-quant."""
    if os.environ.get("KIMI_QUANT_CACHE"):
        return Path(os.environ["KIMI_QUANT_CACHE"]).expanduser()
    for var in ("HF_HOME", "XDG_CACHE_HOME"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser() / "kimi-quant"
    return Path.home() / ".cache" / "kimi-quant"
