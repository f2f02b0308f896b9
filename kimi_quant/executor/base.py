"""The Executor interface: what the driver (``convert``, ``shards.run_shards``) needs from whatever runs jobs.

``Executor`` is a ``typing.Protocol``: the features only some executors have are declared on it with
the value an executor without them has, so the driver reads ``executor.remote`` rather than probe
for it. ``LocalExecutor`` and ``RayExecutor`` subclass it.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol


class Executor(Protocol):
    #: jobs that run at once: the driver keeps that many running (and as many queued)
    slots: int
    #: called with the bytes of input done, from any thread; the driver sets it before submitting
    on_progress: Callable[[int], None]

    # -- optional features: an executor without one keeps the default ----------------------------
    #: workers may be on other nodes: a split shard is hashed and renamed by a job, not by the driver
    remote: bool = False
    #: set once the workers can take jobs (kernels loaded); None: the executor does not say
    ready: threading.Event | None = None
    #: ``time.perf_counter()`` when ``ready`` was set (the driver leaves the time before it out of rates)
    ready_at: float | None = None

    @abstractmethod
    def submit(self, job: dict, paths: dict[str, str], out_dir: str) -> Future:
        """Run ``job`` (``unit.run_job``) on source files ``paths`` into ``out_dir``: a future of its result dict."""

    @abstractmethod
    def shutdown(self, abort: bool = False) -> None:
        """Stop the workers; ``abort``: without waiting for running jobs."""
