"""Where a calibrated conversion's wall time goes: the driver's time split into exclusive phases.

``Phases`` times named, possibly nested, sections of the driver (a nested section's time is not counted in
the one around it). ``scripts/bench_calibrate.py --phases`` reads them: a run writes them as JSON to the file
named by the environment variable ``KIMI_QUANT_CALIB_PHASES`` (nothing is written without it).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV = "KIMI_QUANT_CALIB_PHASES"


class Phases:
    """Exclusive wall seconds per phase name; ``with phases("forward"): ...``."""

    def __init__(self, sync=None):
        self._sync = sync  # waits for a device's queued work, so that its kernels count in the phase that issued them
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # [start, seconds of nested phases]

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._stack.append([time.perf_counter(), 0.0])
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            start, inner = self._stack.pop()
            took = time.perf_counter() - start
            self.seconds[name] += took - inner
            if self._stack:
                self._stack[-1][1] += took

    def observer(self, fn):
        """``fn`` (a forward observer, e.g. a HessianCollector) timed as the phase ``hessians``."""
        def observe(name, x):
            with self("hessians"):
                fn(name, x)
        return observe

    def save(self, total_s: float, extra: dict | None = None) -> None:
        """Write the phases (and the rest of ``total_s`` as ``other``) where ``KIMI_QUANT_CALIB_PHASES`` says."""
        path = os.environ.get(ENV)
        if not path:
            return
        out = {k: round(v, 3) for k, v in sorted(self.seconds.items())}
        out["other"] = round(total_s - sum(self.seconds.values()), 3)
        out["total"] = round(total_s, 3)
        Path(path).write_text(json.dumps({**out, **(extra or {})}, sort_keys=True))
