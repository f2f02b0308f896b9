"""Local executor: one worker process per core (numba kernels run single-threaded in each).

Processes rather than threads because the int4/MX kernels hold the GIL-free core for long
stretches and torch/numpy intra-op threading on 2 cores was measured to be erratic.
With ``workers=1`` units run in the driver process itself (no spawn cost, easy debugging).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import contextlib
import queue
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Callable

from .unit import convert_unit

_progress_queue = None


@contextlib.contextmanager
def _children_ignore_sigint():
    """Processes spawned inside inherit SIGINT ignored (kept across exec; Python then installs no
    handler): Ctrl-C reaches the driver alone, which aborts the workers, and no worker prints a
    KeyboardInterrupt traceback of its own."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _init_worker(q) -> None:
    global _progress_queue
    _progress_queue = q
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """A worker whose driver died (SIGKILL, OOM killer) exits instead of idling forever; its
    unfinished shard stays a .partial that the resumed run removes."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _warm_worker() -> None:
    from ..quant import warmup

    warmup()


def _run_unit(unit: dict, paths: dict[str, str], out_dir: str) -> dict:
    q = _progress_queue
    return convert_unit(unit, paths, out_dir, progress=(q.put if q is not None else None))


class LocalExecutor:
    def __init__(self, workers: int | None = None, on_progress: Callable[[int], None] | None = None,
                 prestart: bool = False):
        self.workers = max(1, int(workers or os.cpu_count() or 1))
        self.on_progress = on_progress or (lambda n: None)
        self.slots = self.workers
        self._pool = None
        if self.workers > 1:
            from ..quant import warmup

            warmup()  # compile (or load) the kernels once here, so workers load them from numba's cache
            ctx = mp.get_context("spawn")
            self._queue = ctx.Queue()
            self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker,
                                             initargs=(self._queue,))
            self._stop = threading.Event()
            self._drain = threading.Thread(target=self._drain_progress, daemon=True)
            self._drain.start()
            if prestart:  # spawn every worker now; each imports and loads the kernels in parallel
                with _children_ignore_sigint():
                    for _ in range(self.workers):
                        self._pool.submit(_warm_worker)

    def _drain_progress(self) -> None:
        while not self._stop.is_set():
            try:
                self.on_progress(self._queue.get(timeout=0.2))
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return

    def submit(self, unit: dict, paths: dict[str, str], out_dir: str) -> Future:
        if self._pool is not None:
            with _children_ignore_sigint():  # the pool may spawn a worker here
                return self._pool.submit(_run_unit, unit, paths, out_dir)
        fut: Future = Future()
        try:
            fut.set_result(convert_unit(unit, paths, out_dir, progress=self.on_progress))
        except BaseException as e:  # noqa: BLE001 - delivered through the future like a pool would
            fut.set_exception(e)
        return fut

    def shutdown(self, abort: bool = False) -> None:
        if self._pool is None or self._stop.is_set():
            return
        if abort:
            for p in list(getattr(self._pool, "_processes", {}).values()):
                p.terminate()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._stop.set()
        self._drain.join(timeout=2)
        while True:  # deliver progress still queued
            try:
                self.on_progress(self._queue.get_nowait())
            except (queue.Empty, EOFError, OSError):
                break


def make_executor(kind: str, workers: int | None, on_progress, prestart: bool = False, **options):
    if kind == "local":
        return LocalExecutor(workers, on_progress, prestart=prestart)
    if kind == "ray":
        from .ray_executor import RayExecutor  # optional extra: pip install kimi-quant[ray]

        return RayExecutor(workers=workers, on_progress=on_progress, **options)
    raise ValueError(f"unknown executor {kind!r}")
