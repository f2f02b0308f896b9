"""The GPTQ problems of a layer as jobs, and the runners that solve them: in this process (``SerialRunner``)
or in local worker processes (``ProcessRunner``); ``ray_jobs.RayRunner`` runs them as Ray tasks.

A job is self-contained (the weight as stored in the source, decoded where the job runs; the Hessian of its
inputs; the codec's name and the GPTQ settings) and ``run_gptq_job`` is a pure function of it, run on one thread wherever it runs: the bytes do
not depend on the runner or on how many workers it has. Linears fed the same input (q/k/v, an expert's
w1/w3) hold the same Hessian object; a runner sends it once where it can (Ray) and the driver keeps one copy.

A routed expert is one ``ExpertJob``: its Linears' GPTQ problems with the token rows the router sends it instead
of Hessians; the worker forms the Hessians (and w2's input, the expert's forward) itself, so that share of the
forward runs on the workers, in parallel, and the driver never holds an expert's Hessian.

Every runner has ``run(jobs) -> iterator of results``, one result per Linear, in the order of the jobs, taking
jobs from the iterable only as workers need them (a window of about two per worker), so the driver holds the
weights and Hessians (or rows) of that window, not of the whole layer. Consecutive jobs that share a Hessian go
to one worker together (``shared_hessian_groups``): it factors that Hessian once for all of them, as one process
would.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace

import numpy as np

from ..errors import BadCheckpoint, KimiQuantError
from ..executor.unit import SourceValues
from ..quant.base import get_codec
from ..quant.gptq import GPTQConfig, gptq_quantize

log = logging.getLogger(__name__)

#: times the worker processes may die (the OOM killer, a kill) before the run gives up
MAX_RESTARTS = 3
#: jobs handed out per worker at once: one running, one waiting, so a worker never idles on the driver
JOBS_PER_WORKER = 2


@dataclass(frozen=True)
class GPTQJob:
    """One Linear's GPTQ problem. ``name``: the source tensor (for messages); ``role``: attention, mlp,
    expert or head; ``scheme``, ``group_size``, ``pow2_scale``, ``matmul``: the codec as the plan has it;
    ``weight``: [N, K], float32 or the source's arrays (``SourceValues``: half the bytes of float32 for BF16, an
    eighth for packed MXFP4, decoded by the worker); ``hessian``: (1/n) sum x x^T [K, K] of its inputs."""

    name: str
    role: str
    scheme: str
    group_size: int
    pow2_scale: bool
    matmul: str | None
    weight: np.ndarray | SourceValues
    hessian: np.ndarray
    config: GPTQConfig

    @property
    def codec(self):
        codec = get_codec(self.scheme, self.group_size)
        return codec.with_pow2_scale() if self.pow2_scale else codec


def run_gptq_job(job: GPTQJob) -> dict[str, np.ndarray]:
    """The codec's on-disk tensors of ``job.weight`` quantized by GPTQ against ``job.hessian``, computed on
    one thread (torch's intra-op threads would make the result depend on where it ran)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return dict(gptq_quantize(job.codec, float32(job.weight), job.matmul, job.hessian, job.config))
    except ValueError as e:  # codecs refuse NaN / Inf
        raise BadCheckpoint(f"tensor {job.name!r}: {e}") from None
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class ExpertJob:
    """A routed expert's GPTQ problems, given the token rows that reach it instead of its Hessians.

    Where it runs, the Hessian of w1 / w3 is formed from ``rows`` and that of w2 from the expert's BF16 forward on
    them, ``glu(rows W1^T, rows W3^T)``: the same arithmetic as the driver's collector on the same inputs
    (``hessian.hessian_of_rows``), so the bytes do not depend on where it runs. ``jobs``: a GPTQJob per calibrated
    Linear of the expert, in plan order, ``hessian`` unset (``matmul`` tells gate / up from down); ``rows``: per
    calibration batch the expert's input rows, float32 [n_b, R] (the tokens routed to it, or every token);
    ``w1``, ``w3``: as a GPTQJob's weight, for w2's input; ``text``: the model's TextConfig (its GLU)."""

    name: str
    jobs: tuple[GPTQJob, ...]
    rows: tuple[np.ndarray, ...]
    w1: np.ndarray | SourceValues
    w3: np.ndarray | SourceValues
    text: object

    def hessians(self, gate_up: bool = True, down: bool = True) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(H of w1 / w3, H of w2) from the rows (each only if asked for); None without rows."""
        import torch

        from ..runtime.forward import glu
        from .hessian import hessian_of_rows

        rows = [torch.from_numpy(r) for r in self.rows]
        h_in = hessian_of_rows(rows) if gate_up else None
        h_mid = None
        if down:
            W1, W3 = torch.from_numpy(float32(self.w1)), torch.from_numpy(float32(self.w3))
            h_mid = hessian_of_rows(glu(self.text, x @ W1.t(), x @ W3.t()) for x in rows)
        return h_in, h_mid


def run_expert_job(job: ExpertJob) -> list[dict[str, np.ndarray]]:
    """The codecs' tensors of each of ``job.jobs``, in order, after forming their Hessians (all on one thread)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if not any(len(r) for r in job.rows):
            raise ValueError("no token rows reach it")
        down = [j.matmul == "down" for j in job.jobs]
        out: list = [None] * len(down)
        h_in, _ = job.hessians(gate_up=True, down=False) if not all(down) else (None, None)
        for i in (i for i, d in enumerate(down) if not d):  # first: a bad w1 / w3 is named, not w2 it feeds
            out[i] = run_gptq_job(replace(job.jobs[i], hessian=h_in))
        if any(down):
            _, h_mid = job.hessians(gate_up=False, down=True)
            for i in (i for i, d in enumerate(down) if d):
                out[i] = run_gptq_job(replace(job.jobs[i], hessian=h_mid))
        return out
    finally:
        torch.set_num_threads(threads)


Job = GPTQJob | ExpertJob


def float32(weight: np.ndarray | SourceValues) -> np.ndarray:
    """A job's weight as float32 (decoded where the job runs)."""
    return weight.f32() if isinstance(weight, SourceValues) else weight


def run_gptq_jobs(jobs: list[Job]) -> list[dict[str, np.ndarray]]:
    """The results of each job, in order (one per Linear): jobs sharing a Hessian reuse its factor (``gptq`` keeps
    the last)."""
    out = []
    for job in jobs:
        out += run_expert_job(job) if isinstance(job, ExpertJob) else [run_gptq_job(job)]
    return out


def results_of(job: Job) -> int:
    """How many results ``job`` gives (one per Linear)."""
    return len(job.jobs) if isinstance(job, ExpertJob) else 1


def shared_hessian_groups(jobs: Iterable[Job]) -> Iterator[list[Job]]:
    """``jobs`` in runs of consecutive jobs holding the same Hessian object (q/k/v, a dense MLP's gate/up); an
    ExpertJob is a run of its own."""
    group: list[Job] = []
    for job in jobs:
        if group and (isinstance(job, ExpertJob) or isinstance(group[-1], ExpertJob)
                      or job.hessian is not group[-1].hessian):
            yield group
            group = []
        group.append(job)
    if group:
        yield group



class SubmitWindow:
    """The groups of ``jobs`` (``shared_hessian_groups``) handed to ``submit`` in job order, at most ``size``
    outstanding: ``pending`` holds ``[group, handle]`` entries, the oldest first; ``fill`` tops it up."""

    def __init__(self, jobs: Iterable[Job], submit, size: int):
        self._groups = shared_hessian_groups(jobs)
        self._submit = submit
        self._size = size
        self.pending: deque[list] = deque()

    def fill(self) -> None:
        while len(self.pending) < self._size:
            group = next(self._groups, None)
            if group is None:
                return
            self.pending.append([group, self._submit(group)])

def job_failure(job: GPTQJob, exc: BaseException) -> KimiQuantError:
    """The one line a failed job stops the run with (a KimiQuantError keeps its class: its exit code)."""
    text = str(exc).strip().splitlines()
    what = text[0].strip() if text else type(exc).__name__
    if isinstance(exc, KimiQuantError):
        msg = what if job.name in what else f"GPTQ of {job.name}: {what}"
        try:
            err = type(exc)(msg)
        except Exception:  # noqa: BLE001 - a subclass with another constructor
            err = KimiQuantError(msg)
    else:
        err = KimiQuantError(f"GPTQ of {job.name} failed: {type(exc).__name__}: {what}")
    err.__cause__ = exc
    return err


def _warm_up() -> None:
    import torch  # noqa: F401 - what a worker's first job would otherwise wait for

    from ..quant import gptq_kernels  # noqa: F401


def _named(group: list[Job]) -> Job:
    """A stand-in job whose name lists every tensor of ``group`` (for a failure of the group as a whole)."""
    return group[0] if len(group) == 1 else replace(group[0], name=" / ".join(j.name for j in group))


class SerialRunner:
    """Every job in this process, one after the other."""

    workers = 1

    def run(self, jobs: Iterable[Job]) -> Iterator[dict[str, np.ndarray]]:
        for job in jobs:
            try:
                outs = run_gptq_jobs([job])
            except Exception as e:  # noqa: BLE001 - one line naming the tensor
                raise job_failure(job, e) from e
            yield from outs

    def close(self, abort: bool = False) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        self.close(abort=kind is not None)


class ProcessRunner(SerialRunner):
    """Jobs in ``workers`` local processes, forked from the project's fork server (kernels loaded, one BLAS
    thread, SIGINT left to the driver). A worker that dies takes the pool with it: a new pool redoes every
    job not finished yet (the run says so), up to MAX_RESTARTS times."""

    def __init__(self, workers: int):
        self.workers = max(1, int(workers))
        self._pool: ProcessPoolExecutor | None = None
        self._opening = threading.Lock()
        self.restarts = 0

    def _open(self) -> ProcessPoolExecutor:
        with self._opening:
            if self._pool is None:
                from ..executor.fork_server import start_fork_server

                self._pool = ProcessPoolExecutor(self.workers, mp_context=start_fork_server())
                for _ in range(self.workers):  # torch and GPTQ load in every worker while the driver runs a forward
                    self._pool.submit(_warm_up)
            return self._pool

    def __enter__(self):
        # Started beside the driver: the first worker waits for the fork server to import torch and the
        # kernels (seconds), which the driver's first forward need not wait for
        threading.Thread(target=self._open, name="kimi-quant-gptq-workers", daemon=True).start()
        return self

    def _submit(self, group: list[Job]) -> Future:
        try:
            return self._open().submit(run_gptq_jobs, group)
        except BrokenProcessPool as e:  # a worker died before this job was handed out
            fut: Future = Future()
            fut.set_exception(e)
            return fut

    def _restart(self, pending: deque) -> None:
        self.restarts += 1
        if self.restarts > MAX_RESTARTS:
            raise KimiQuantError(f"GPTQ worker processes died {self.restarts} times (killed by a signal: the OOM "
                                 "killer?); finished layers are kept: re-run the same command to resume "
                                 "(fewer --workers use less memory)")
        lost = [e for e in pending if not e[1].done() or e[1].exception() is not None]
        log.warning("kimi-quant: warning: a GPTQ worker process died (killed by a signal: the OOM killer?); "
                    "redoing %d unfinished GPTQ jobs in new workers", sum(len(e[0]) for e in lost))
        self.close(abort=True)
        for entry in lost:
            entry[1] = self._submit(entry[0])

    def run(self, jobs: Iterable[Job]) -> Iterator[dict[str, np.ndarray]]:
        window = SubmitWindow(jobs, self._submit, JOBS_PER_WORKER * self.workers)
        pending = window.pending  # [group, future]
        window.fill()
        while pending:
            group, fut = pending[0]
            try:
                outs = fut.result()
            except BrokenProcessPool:
                self._restart(pending)
                continue
            except KimiQuantError as e:  # names its tensor (run_gptq_job)
                raise job_failure(next((j for j in group if j.name in str(e)), group[0]), e) from e
            except Exception as e:  # noqa: BLE001 - one line naming the tensors
                raise job_failure(_named(group), e) from e
            pending.popleft()
            window.fill()
            yield from outs

    def pids(self) -> list[int]:
        """The worker processes now running (none before the first job)."""
        procs = getattr(self._pool, "_processes", None) or {}
        return sorted(procs)

    def close(self, abort: bool = False) -> None:
        with self._opening:  # not while the pool is being opened
            pool, self._pool = self._pool, None
        if pool is None:
            return
        if abort:
            for p in list((getattr(pool, "_processes", None) or {}).values()):
                p.terminate()
        pool.shutdown(wait=True, cancel_futures=True)

