"""GPTQ jobs (``jobs.GPTQJob``) as Ray tasks: ``convert --calibrate --executor ray``.

Unlike the data-free path's tasks, these carry their data: the weight and the Hessian go through Ray's
object store (a Hessian shared by several Linears is put once), so workers need no shared filesystem.
A task whose worker or node dies is retried by Ray (``MAX_RETRIES``); a task that raises is deterministic
and stops the run with one line naming the tensor.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import replace

import numpy as np

from .. import __version__
from ..errors import KimiQuantError
from ..executor.ray_executor import MAX_RETRIES, SYSTEM_ERRORS, connect, one_line
from .jobs import JOBS_PER_WORKER, GPTQJob, job_failure, run_gptq_job

import ray  # noqa: E402 - after ray_executor, which turns a missing Ray into one line


@ray.remote(num_cpus=1, max_retries=MAX_RETRIES)
def _gptq_task(job: GPTQJob, weight: np.ndarray, hessian: np.ndarray, version: str) -> dict:
    import kimi_quant

    if kimi_quant.__version__ != version:
        raise KimiQuantError(f"a Ray node runs kimi-quant {kimi_quant.__version__} but the driver runs {version}; "
                             "install the same version on every node")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_gptq_job(replace(job, weight=weight, hessian=hessian))


class RayRunner:
    """Jobs as Ray tasks, ``workers`` at once (default: the cluster's CPUs), results in job order."""

    def __init__(self, workers: int | None = None, address: str | None = None, **_ignored):
        self._owns_ray = connect(address, workers, object_store=None)
        cpus = int(ray.cluster_resources().get("CPU", 0))
        self.workers = max(1, int(workers) if workers else cpus)
        self._hessians: dict[int, tuple[np.ndarray, object]] = {}  # id -> (the array, kept alive; its ref)

    def _hessian_ref(self, h: np.ndarray):
        hit = self._hessians.get(id(h))
        if hit is None or hit[0] is not h:
            hit = self._hessians[id(h)] = (h, ray.put(h))
        return hit[1]

    def run(self, jobs: Iterable[GPTQJob]) -> Iterator[dict[str, np.ndarray]]:
        source = iter(jobs)
        pending: deque[tuple[GPTQJob, object]] = deque()
        window = JOBS_PER_WORKER * self.workers

        def fill() -> None:
            while len(pending) < window:
                job = next(source, None)
                if job is None:
                    return
                bare = replace(job, weight=np.empty(0, np.float32), hessian=np.empty(0, np.float64))
                ref = _gptq_task.remote(bare, job.weight, self._hessian_ref(job.hessian), __version__)
                pending.append((job, ref))

        try:
            fill()
            while pending:
                job, ref = pending[0]
                try:
                    out = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None) or e
                    raise job_failure(job, cause) from cause
                except SYSTEM_ERRORS as e:
                    raise KimiQuantError(f"GPTQ of {job.name} failed after {MAX_RETRIES + 1} attempts: "
                                         f"{type(e).__name__}: {one_line(e)}") from e
                pending.popleft()
                live = {id(j.hessian) for j, _ in pending}
                if id(job.hessian) not in live:
                    self._hessians.pop(id(job.hessian), None)
                fill()
                yield out
        finally:
            for _, ref in pending:
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001 - already finished or its node is gone
                    pass
            self._hessians.clear()

    def close(self, abort: bool = False) -> None:
        if self._owns_ray:  # stops a cluster we started; for a joined one this only disconnects
            self._owns_ray = False
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        self.close(abort=kind is not None)
