"""The local executor's fork server, started as early as the driver knows it will need one.

Workers fork from a ``multiprocessing`` fork server that has imported the unit code and loaded the
kernels (``preload.py``): ~0.2 s of one core (python, numpy, the compiled kernels of ``quant.aot``;
~0.9 s where the kernels are numba's JIT ones), which nothing else waits on once the server is
started. This module imports nothing heavy, so ``kimi-quant convert`` starts the server right after
parsing its options, before the driver imports numpy and plans (``start_fork_server``); the
executor's own start finds it running.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
from multiprocessing import forkserver

PRELOAD = f"{__package__}.preload"


def default_workers() -> int:
    """Workers when the user names none: one per core."""
    return os.cpu_count() or 1


def start_fork_server():
    """Start the fork server (once per process; a no-op while it runs) and return the ``forkserver``
    context to build the pool on. It starts loading at once and the call does not wait for it.
    Started by a process that exits without using it, it exits too (it reads EOF from the driver)."""
    _quiet_resource_tracker()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    with _worker_birth():
        forkserver.ensure_running()
    return ctx


def fork_server_pid() -> int | None:
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


#: BLAS / OpenMP pools would start a thread per core in every worker (and spin between calls):
#: workers are one per core already.  Set before the fork server imports numpy.
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@contextlib.contextmanager
def _worker_birth():
    """Processes started inside (the fork server, and so every worker it forks) inherit:

    * SIGINT blocked (the mask survives fork and exec, and nothing there unblocks it): Ctrl-C reaches
      the driver alone, which aborts the workers, and no worker prints a KeyboardInterrupt traceback.
      Blocked in this thread, not ignored: a Ctrl-C meanwhile still reaches the driver (through
      another thread, or when the mask is restored) instead of being lost;
    * single-threaded BLAS / OpenMP (``_ONE_THREAD``, unless the user set them);
    * no import from the current directory (``_safe_import_path``)."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with _environ(_ONE_THREAD, keep_users=True), _safe_import_path():
            yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextlib.contextmanager
def _environ(values: dict[str, str], keep_users: bool = False):
    """``os.environ`` updated with ``values`` inside (``keep_users``: a variable already set stays as is)."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if not (keep_users and k in os.environ):
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _safe_import_path():
    """Helpers multiprocessing starts as ``python -c ...`` (its resource tracker, the fork server) would
    have the current directory first on their import path: a ``numba.py`` in the directory the user ran
    kimi-quant from would be imported, and run, in place of numba. Workers get the driver's own path."""
    return _environ({"PYTHONSAFEPATH": "1"})


def _quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker with its stderr on /dev/null. Its only words are the
    "leaked semaphore objects to clean up" warning it prints when the driver was killed (kill -9, the
    OOM killer) before closing the queues: it cleans them up all the same, and a killed run is resumed
    by re-running the command, so the warning only alarms. Started here, before any queue exists."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_fd", None) is not None:
        return  # already running (an earlier executor in this process)
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null, _safe_import_path():
            os.dup2(null.fileno(), 2)
            try:
                tracker.ensure_running()
            finally:
                os.dup2(saved, 2)
    except OSError:
        pass
    finally:
        os.close(saved)
