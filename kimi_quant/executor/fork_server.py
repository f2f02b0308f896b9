"""How the local executor's workers come to exist: forked from the driver itself, or from a fork server.

**Forked from the driver** (``fork_workers_here``: Linux, and the driver still has a single thread and no
torch): the driver has imported the unit code for its own planning already; it loads the kernels and
forks each worker from its only thread. A worker then starts in milliseconds with everything loaded,
and nothing else runs at start-up: no second interpreter importing numpy, no resource tracker (queues
of the fork context unlink their semaphores at once, so none can leak either). ~0.4 core-s less per run
than the fork server, and on a small machine the workers start ~0.2 s sooner.

**From a fork server** otherwise (the driver has threads, or torch for ``--validate``): a ``multiprocessing``
fork server that has imported the unit code and loaded the kernels (``preload.py``): ~0.2 s of one core
(python, numpy, the compiled kernels of ``quant.aot``; ~0.9 s where the kernels are numba's JIT ones).
``kimi-quant convert`` starts it right after parsing its options (``start_fork_server``), so that it
loads while the driver imports numpy and plans; the executor's own start finds it running.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
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


def fork_workers_here() -> bool:
    """Whether workers can be forked from this process (see the module's doc): fork copies the calling
    thread alone, so a lock another thread holds would stay locked forever in the worker; torch's
    thread pools do not survive a fork either. And the compiled kernels must be there to load: building
    them (~20 s, the first run on a machine) or setting up numba's JIT is left to a fork server, beside
    the driver's planning, where an abort can stop it at once (numba's compiler swallows a Ctrl-C)."""
    if not (sys.platform.startswith("linux") and _threads() == 1 and "torch" not in sys.modules):
        return False
    from ..quant import aot

    return aot.state() == "built"


def _threads() -> int:
    """Threads of this process, native ones included (numpy's OpenBLAS starts a pool at import unless
    OPENBLAS_NUM_THREADS=1, as the CLI sets it; Python 3.12+ warns when such a process forks)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return threading.active_count()


@contextlib.contextmanager
def sigint_blocked():
    """SIGINT blocked in this thread inside: processes started meanwhile keep it blocked (the mask survives
    fork and exec), so a Ctrl-C reaches the driver alone, which aborts the workers, and no worker prints a
    KeyboardInterrupt traceback. Blocked, not ignored: a Ctrl-C meanwhile still reaches the driver (through
    another thread, or when the mask is restored) instead of being lost."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def fork_server_pid() -> int | None:
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


#: BLAS / OpenMP pools would start a thread per core in every worker (and spin between calls):
#: workers are one per core already.  Set before the fork server imports numpy.
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@contextlib.contextmanager
def _worker_birth():
    """Processes started inside (the fork server, and so every worker it forks) inherit SIGINT blocked
    (``sigint_blocked``), single-threaded BLAS / OpenMP (``_ONE_THREAD``, unless the user set them) and
    no import from the current directory (``_safe_import_path``)."""
    with sigint_blocked(), _environ(_ONE_THREAD, keep_users=True), _safe_import_path():
        yield


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
