"""GPTQ jobs (``jobs.GPTQJob``, ``jobs.ExpertJob``) as Ray tasks: ``convert --calibrate --executor ray``.

Unlike the data-free path's tasks, these carry their data: the weight and the Hessian (a routed expert: its
weights and token rows) go through Ray's object store (Linears sharing a Hessian are one task: it is sent and
factored once), so workers need no shared filesystem.
A task whose worker or node dies (or whose arguments were lost with a node) is submitted again by the driver,
with one warning naming its tensors, up to ``MAX_RETRIES`` times (the same job gives the same bytes wherever it
runs); a task that raises is deterministic and stops the run with one line naming the tensor.
With ``--device cuda|npu`` each task asks Ray for a share of one GPU (NPU), so that the runner's workers spread
evenly over the cluster's devices and never land on a node without one (``device_share``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import replace

import numpy as np

from .. import __version__
from ..errors import KimiQuantError
from ..executor.ray_executor import MAX_RETRIES, SYSTEM_ERRORS, connect, one_line
from .jobs import JOBS_PER_WORKER, ExpertJob, Job, SubmitWindow, job_failure, run_gptq_jobs

import ray  # noqa: E402 - after ray_executor, which turns a missing Ray into one line

log = logging.getLogger(__name__)


# retried by the driver (RayRunner.run), which says so; Ray's own retries would be silent
@ray.remote(num_cpus=1, max_retries=0)
def _gptq_task(jobs: list[Job], weights: list[np.ndarray], hessian: np.ndarray | None, version: str) -> list[dict]:
    """Jobs sharing ``hessian`` (their arrays sent beside them), or one ExpertJob (``weights`` empty: it carries
    its own rows and weights)."""
    import kimi_quant

    if kimi_quant.__version__ != version:
        raise KimiQuantError(f"a Ray node runs kimi-quant {kimi_quant.__version__} but the driver runs {version}; "
                             "install the same version on every node")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if weights:
        jobs = [replace(job, weight=w, hessian=hessian) for job, w in zip(jobs, weights)]
    return run_gptq_jobs(jobs)


#: the Ray resource of each ``--device`` (Ray detects both: NVIDIA GPUs, and Ascend NPUs as "NPU")
RAY_RESOURCE = {"cuda": "GPU", "npu": "NPU"}


def device_share(device: str, workers: int, resources: dict) -> dict:
    """The Ray options that give each of ``workers`` tasks a share of one ``device`` of the cluster (whose
    ``resources`` are ``ray.cluster_resources()``): ``{}`` on the CPU; else a fraction ``1 / ceil(workers /
    devices)`` of one, so the tasks spread evenly over the devices (Ray hands each task one device's id in
    ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES``) and never go to a node without one. A cluster with
    none is refused in one line: Ray would hold such tasks pending for ever."""
    if device == "cpu":
        return {}
    name = RAY_RESOURCE[device]
    have = int(resources.get(name, 0))
    if have < 1:
        raise KimiQuantError(f"--device {device} --executor ray: the Ray cluster has no {name} (it has "
                             f"{int(resources.get('CPU', 0))} CPUs); start its nodes with their devices "
                             f"(`ray start --resources` / `--num-gpus`) or use --device cpu")
    per = math.ceil(workers / have)  # tasks sharing one device
    share = 1.0 if per <= 1 else math.floor(1e4 / per) / 1e4  # Ray counts fractions in steps of 1e-4
    if share <= 0:
        raise KimiQuantError(f"--workers {workers} would put {per} tasks on each of {have} {name}s (Ray shares one "
                             "device among at most 10000): use fewer --workers")
    return {"num_gpus": share} if name == "GPU" else {"resources": {name: share}}


class RayRunner:
    """Jobs as Ray tasks, ``workers`` at once (default: the cluster's CPUs), results in job order; consecutive
    jobs sharing a Hessian are one task (the Hessian sent and factored once). ``device``: where the jobs' GPTQ
    runs (``--device``); each task then holds a share of one of the cluster's devices (``device_share``)."""

    def __init__(self, workers: int | None = None, address: str | None = None, device: str = "cpu", **_ignored):
        self._owns_ray = connect(address, workers, object_store=None)
        try:
            resources = ray.cluster_resources()
            self.workers = max(1, int(workers) if workers else int(resources.get("CPU", 0)))
            self.task_options = device_share(device, self.workers, resources)
        except BaseException:
            self.close()
            raise
        self._task = _gptq_task.options(**self.task_options) if self.task_options else _gptq_task

    def run(self, jobs: Iterable[Job]) -> Iterator[dict[str, np.ndarray]]:
        def submit(group: list[Job]):  # the arrays travel as their own objects, the Hessian once
            if isinstance(group[0], ExpertJob):
                return self._task.remote(group, [], None, __version__)
            bare = [replace(j, weight=np.empty(0, np.float32), hessian=np.empty(0, np.float64)) for j in group]
            return self._task.remote(bare, [j.weight for j in group], group[0].hessian, __version__)

        window = SubmitWindow(jobs, submit, JOBS_PER_WORKER * self.workers)
        pending = window.pending  # [group, object ref]
        lost = 0  # times the oldest pending group was lost (only the oldest is waited on, so retried)
        try:
            window.fill()
            while pending:
                group, ref = pending[0]
                try:
                    outs = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None) or e
                    job = next((j for j in group if j.name in str(cause)), group[0])
                    raise job_failure(job, cause) from cause
                except SYSTEM_ERRORS as e:
                    names = " / ".join(j.name for j in group)
                    lost += 1
                    if lost > MAX_RETRIES:
                        raise KimiQuantError(f"GPTQ of {names} failed after {lost} attempts: "
                                             f"{type(e).__name__}: {one_line(e)}") from e
                    log.warning("kimi-quant: warning: the Ray task running GPTQ of %s was lost (%s: %s); "
                                "redoing it (attempt %d of %d)", names, type(e).__name__, one_line(e), lost + 1,
                                MAX_RETRIES + 1)
                    pending[0][1] = submit(group)
                    continue
                lost = 0
                pending.popleft()
                window.fill()
                yield from outs
        finally:
            for _, ref in pending:
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001 - already finished or its node is gone
                    pass

    def close(self, abort: bool = False) -> None:
        if self._owns_ray:  # stops a cluster we started; for a joined one this only disconnects
            self._owns_ray = False
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        self.close(abort=kind is not None)
