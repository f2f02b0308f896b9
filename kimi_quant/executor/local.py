"""Local executor: one worker process per core (numba kernels run single-threaded in each).

Processes rather than threads: the int4/MX kernels hold a core for long stretches, and torch/numpy
intra-op threading on few cores is erratic.
Workers are forked with the unit code imported and the kernels loaded, from the driver itself
where that is safe, else from a fork server (``fork_server``): a worker starts in milliseconds
instead of re-importing numpy and the kernels, missing kernels are built once (``quant.aot``),
and a finished worker leaves with ``os._exit`` instead of a slow interpreter teardown.
With ``workers=1`` units run in the driver process itself (no start-up cost, easy debugging).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing as mp
import os
import queue
import select
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from ..errors import KimiQuantError
from .base import Executor
from .fork_server import default_workers, fork_server_pid, fork_workers_here, sigint_blocked, start_fork_server
from .unit import run_job

_progress_queue = None
#: How often the progress thread looks for the end of the run: shutdown waits for it once. Not woken
#: through the queue: a worker killed mid-put leaves the queue's lock held, and a put would hang.
_DRAIN_POLL = 0.03


def _started_thread(t: threading.Thread | None) -> bool:
    return t is not None and t.ident is not None  # a Ctrl-C may land between Thread() and start()


@contextlib.contextmanager
def _no_interrupts(active: bool):
    """SIGINT ignored inside (main thread only; elsewhere Python runs no handler anyway)."""
    previous = None
    if active:
        try:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:
            pass
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


#: What a worker's heap may keep free for its next tensors (see ``keep_freed_memory``): more than one
#: tensor's outputs plus what a writer holds for its turn (``write.shard_parts.HOLD_BYTES``, 32 MiB).
KEEP_FREED = 128 * 1024 * 1024
#: Blocks above this still come from mmap and go back at once (a heap keeps a freed block below a live
#: one): glibc's largest mmap threshold, which fixed here no longer adapts.
MMAP_ABOVE = 32 * 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Make this process's heap keep what it frees (up to ``KEEP_FREED``) for its next allocations, instead
    of handing it back to the kernel; False where that cannot be set (no glibc: nothing changes).

    A worker allocates and frees the same few buffers tensor after tensor: one tensor's codes and scales,
    and up to HOLD_BYTES of them while its writer waits for a turn. By default glibc gives blocks above
    its (adaptive) mmap threshold back at once, and trims the heap's top whenever more than twice the
    last such block is free there; each next tensor would then fault its buffers in again and have the
    kernel zero them (page-fault counts: docs/performance.md)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_ABOVE)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_FREED))


def _init_worker(q, driver: int) -> None:
    global _progress_queue
    _progress_queue = q
    keep_freed_memory()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # blocked already: workers start inside sigint_blocked
    threading.Thread(target=_exit_with_driver, args=(driver,), daemon=True).start()


def _exit_with_driver(driver: int) -> None:
    """A worker whose driver died (SIGKILL, OOM killer) exits at once instead of finishing its unit
    and committing a shard that a resumed run may be rewriting; the unfinished shard stays a
    .partial that the resumed run removes.  Nothing tells a process that its parent died (and workers
    of a fork server are not the driver's children at all), so the driver is watched by pid: a pidfd
    turns readable when it exits."""
    try:
        fd = os.pidfd_open(driver)
    except (AttributeError, OSError):  # no pidfd (not Linux >= 5.3): poll
        while _alive(driver):
            time.sleep(0.2)
        os._exit(1)
    select.select([fd], [], [])
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _started() -> None:
    """Submitted once per worker by the launcher thread: the pool starts a process for each."""


#: A worker sends its progress at most this often (seconds), and once more at the end of each job.
PROGRESS_EVERY = 0.25


class _Batched:
    """A worker's progress, sent every ``PROGRESS_EVERY`` s instead of after every tensor: each put
    wakes the queue's feeder thread, which takes the GIL from the converting thread."""

    def __init__(self, put: Callable[[int], None]):
        self.put, self.pending, self.last = put, 0, time.monotonic()

    def __call__(self, n: int) -> None:
        self.pending += n
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        if self.pending:
            self.put(self.pending)
            self.pending = 0
        self.last = time.monotonic() if now is None else now


def _run_job(job: dict, paths: dict[str, str], out_dir: str) -> dict:
    q = _progress_queue
    if q is None:
        return run_job(job, paths, out_dir)
    progress = _Batched(q.put)
    try:
        return run_job(job, paths, out_dir, progress=progress)
    finally:
        progress.flush()


class LocalExecutor(Executor):
    """Call ``start()`` (the caller holds the object first, so a Ctrl-C during the start still
    reaches ``shutdown``, which copes with any part started)."""

    def __init__(self, workers: int | None = None, on_progress: Callable[[int], None] | None = None):
        self.workers = max(1, int(workers or default_workers()))
        most = 8 * (os.cpu_count() or 1)
        if self.workers > most:  # each is a process holding a tensor: a typo'd 100000 would exhaust the machine
            raise KimiQuantError(f"--workers {self.workers} is more than {most} (8 per core on this machine): more "
                                 "processes than that only cost memory; use fewer")
        self.on_progress = on_progress or (lambda n: None)
        self.slots = self.workers
        self._pool = self._queue = self._drain = self._launcher = self._warm = None
        self._stop = threading.Event()
        #: when the kernels were loaded (compiled on a cold numba cache) and work could begin: the
        #: driver leaves the time before it out of the conversion rate and the bar's ETA
        self.ready: threading.Event = threading.Event()
        self.ready_at: float | None = None

    def _mark_ready(self, *_) -> None:
        if not self.ready.is_set():
            self.ready_at = time.perf_counter()
            self.ready.set()

    def start(self) -> "LocalExecutor":
        if self._pool is not None or self._warm is not None:
            return self
        if self.workers == 1:  # units run here: load the kernels in the background while the driver plans
            self._warm = threading.Thread(target=self._warm_up, name="kq-warmup", daemon=True)
            self._warm.start()
            return self
        if fork_server_pid() is None and fork_workers_here():
            return self._fork_here()
        # The server starts now unless `kimi-quant convert` started it already (ensure_running does not
        # wait for it) and loads the kernels while the driver plans.  Workers are launched from a
        # thread: a Ctrl-C (handled in the main thread) then never lands inside a launch, and shutdown
        # waits for launches to finish, so no worker is left half-started (it would print a traceback
        # once the driver has gone).
        self._open_pool(start_fork_server())
        self._drain.start()
        self._launcher = threading.Thread(target=self._launch, name="kq-launch", daemon=True)
        self._launcher.start()
        return self

    def _open_pool(self, ctx) -> None:
        self._queue = ctx.Queue()
        self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker,
                                         initargs=(self._queue, os.getpid()))
        self._drain = threading.Thread(target=self._drain_progress, daemon=True)

    def _fork_here(self) -> "LocalExecutor":
        """Fork the workers from this process, now, on its only thread (see ``fork_server``): the pool
        forks them all at its first submit, before it starts its own threads. SIGINT stays blocked
        meanwhile, so a Ctrl-C is handled once the workers exist (and shutdown then stops them)."""
        from ..quant import warmup

        warmup(writable=False)  # loaded once, here (built already: fork_workers_here): every worker inherits them
        gc.freeze()  # what is loaded now lives as long as the workers: their collections need not walk it
        with sigint_blocked():
            self._open_pool(mp.get_context("fork"))
            for _ in range(self.workers):
                self._pool.submit(_started).add_done_callback(self._mark_ready)
        self._drain.start()
        return self

    def _warm_up(self) -> None:
        from ..quant import warmup

        warmup()
        self._mark_ready()

    def _launch(self) -> None:
        try:
            for _ in range(self.workers):
                # a worker runs this once the fork server has loaded the kernels
                self._pool.submit(_started).add_done_callback(self._mark_ready)
        except RuntimeError:  # shut down (Ctrl-C, an error) before every worker was asked for
            pass
        except (OSError, EOFError):  # the fork server was stopped by an abort while it loaded the kernels
            if not self._stop.is_set():
                raise

    def _stop_fork_server(self) -> None:
        """An abort while the fork server still loads (compiles) the kernels: stop it now rather than
        wait for the compilation (up to a minute on a cold cache) before the launches can end."""
        pid = fork_server_pid()
        if pid is None or self.ready.is_set():
            return
        try:
            os.kill(pid, signal.SIGKILL)  # our own child: the server started by start()
        except OSError:
            pass

    def _drain_progress(self) -> None:
        while not self._stop.is_set():
            try:
                self.on_progress(self._queue.get(timeout=_DRAIN_POLL))
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return

    def submit(self, job: dict, paths: dict[str, str], out_dir: str) -> Future:
        if self._pool is not None:
            if self._launcher is not None:
                self._launcher.join()  # the workers exist (interruptible: the launch goes on without us)
            try:
                inner = self._pool.submit(_run_job, job, paths, out_dir)
            except BrokenProcessPool as e:  # a worker died before this job was handed out
                inner = Future()
                inner.set_exception(e)
            return _explained(inner, job["file"])
        if self._warm is not None:
            self._warm.join()
        fut: Future = Future()
        try:
            fut.set_result(run_job(job, paths, out_dir, progress=self.on_progress))
        except BaseException as e:  # noqa: BLE001 - delivered through the future like a pool would
            fut.set_exception(e)
        return fut

    def shutdown(self, abort: bool = False) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._pool is None:
            return
        with _no_interrupts(abort):  # a second Ctrl-C must not cut the clean-up short
            if abort:
                self._stop_fork_server()
            if _started_thread(self._launcher):
                # every launch must be over first: a worker still being started would be missed, and
                # it fails (with a traceback) once the driver has removed the queues it attaches to
                self._launcher.join()
            if abort:
                for p in list(getattr(self._pool, "_processes", {}).values()):
                    p.terminate()
            self._pool.shutdown(wait=True, cancel_futures=True)
        if _started_thread(self._drain):
            self._drain.join(timeout=2)
        while True:  # deliver progress still queued
            try:
                self.on_progress(self._queue.get_nowait())
            except (queue.Empty, EOFError, OSError):
                break


def _explained(inner: Future, file: str) -> Future:
    """``inner``'s outcome, with a dead worker process (the pool's BrokenProcessPool traceback)
    turned into one line that says what to do."""
    outer: Future = Future()

    def done(f: Future) -> None:
        if f.cancelled():
            outer.cancel()
            outer.set_running_or_notify_cancel()
        elif isinstance(f.exception(), BrokenProcessPool):
            outer.set_exception(KimiQuantError(
                f"a worker process died while converting {file} (killed by a signal: the OOM killer?); "
                "completed shards are kept: re-run the same command to resume (fewer --workers use less memory)"))
        elif f.exception() is not None:
            outer.set_exception(f.exception())
        else:
            outer.set_result(f.result())

    inner.add_done_callback(done)
    return outer


def make_executor(kind: str, workers: int | None, on_progress, **options) -> Executor:
    """An executor not yet started (``start()``: processes, threads, a Ray connection)."""
    if kind == "local":
        return LocalExecutor(workers, on_progress)
    if kind == "ray":
        from .ray_executor import RayExecutor  # optional extra: pip install kimi-quant[ray]

        return RayExecutor(workers=workers, on_progress=on_progress, **options)
    raise ValueError(f"unknown executor {kind!r}")
