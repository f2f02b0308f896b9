"""Where kimi-quant keeps what it can re-create: staged hub shards, this machine's codec rates."""

from __future__ import annotations

import hashlib
import os
import platform
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
