"""Ray executor: every job (a whole output shard, or a part of one: executor/shards.py) is one Ray
task on whichever node has a free core.

Only the job's JSON and file *paths* travel (never tensors): each task reads its source shards
and writes its tensors into the output shard's temporary file (created by the driver) itself, so
source and output must sit on a filesystem that every node mounts at the same path (see
docs/distributed.md). The driver in convert.py still owns the journal, index, description and
provenance; a task returns only a small dict (``unit.run_job``).

- ``slots`` is the cluster's CPU count (or ``workers`` when given): the driver keeps that many
  jobs running (and as many queued).
- A task is submitted again (up to ``MAX_RETRIES`` times) when its worker or node dies or it raises
  ``OSError`` (a flaky mount), by the driver, which says so in one warning naming the shard (Ray's own
  retries would be silent); a ``KimiQuantError`` such as ``BadCheckpoint`` is deterministic and is
  not. A unit that still fails stops the run with one line naming its shard.
- Progress: tasks report cumulative input bytes per job to a small actor (a retried attempt
  does not count twice); a driver thread drains it into ``on_progress``.
- With no address, the executor joins ``RAY_ADDRESS`` or a cluster already running on this
  machine, else starts a small local one (and stops only that one on shutdown).
- An address (``HOST:PORT``, ``ray://HOST:PORT``, or ``RAY_ADDRESS``) is probed with a timed TCP
  connect first: ``ray.init`` retries an unreachable one for many minutes instead of failing.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Callable
from urllib.parse import urlsplit

from .. import __version__
from ..errors import KimiQuantError
from .base import Executor
from .unit import job_key, run_job

try:
    import ray
    from ray import exceptions as rex
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise KimiQuantError("the Ray executor needs Ray: pip install 'kimi-quant[ray]'") from e

log = logging.getLogger(__name__)

MAX_RETRIES = 3  # attempts = MAX_RETRIES + 1 for transient failures
FLUSH_SECONDS = 0.5  # how often a task reports progress, and the driver drains it
LOCAL_OBJECT_STORE = 200 * 2**20  # only paths go through the object store
PROBE_SECONDS = 5.0  # how long a cluster address may take to accept a TCP connection

# Failures that Ray retries: the worker process or its node went away, or a transient OSError.
SYSTEM_ERRORS = tuple(getattr(rex, n) for n in ("WorkerCrashedError", "NodeDiedError", "OutOfMemoryError",
                                                 "ObjectLostError", "RaySystemError", "LocalRayletDiedError")
                       if hasattr(rex, n))


@ray.remote(num_cpus=0)
class _Progress:
    """Cumulative input bytes per unit attempt; ``take`` returns what is new since the last call."""

    def __init__(self):
        self.done: dict[str, int] = {}
        self.taken = 0

    def report(self, file: str, cumulative: int) -> None:
        if cumulative > self.done.get(file, 0):
            self.done[file] = cumulative

    def take(self) -> int:
        total = sum(self.done.values())
        new, self.taken = total - self.taken, total
        return new


class _Reporter:
    """Batches a task's per-tensor progress into one actor call every FLUSH_SECONDS."""

    def __init__(self, actor, file: str):
        self.actor, self.file, self.bytes, self.sent, self.last = actor, file, 0, 0, time.monotonic()

    def __call__(self, n: int) -> None:
        self.bytes += n
        if time.monotonic() - self.last >= FLUSH_SECONDS:
            self.flush()

    def flush(self, wait: bool = False) -> None:
        if self.bytes != self.sent:
            ref = self.actor.report.remote(self.file, self.bytes)
            self.sent, self.last = self.bytes, time.monotonic()
            if wait:  # the last report lands before the task's result does, so totals are exact
                ray.get(ref)


def _check_node(paths: dict[str, str], out_dir: str, version: str) -> None:
    """Fail fast, without retries, when this node cannot see the files or runs another version."""
    import kimi_quant

    host = socket.gethostname()
    if kimi_quant.__version__ != version:
        raise KimiQuantError(f"node {host} runs kimi-quant {kimi_quant.__version__} but the driver runs {version}; "
                             "install the same version on every node")
    missing = [p for p in paths.values() if not os.path.isfile(p)]
    if not os.path.isdir(out_dir):
        missing.insert(0, out_dir)
    if missing:
        raise KimiQuantError(f"node {host} cannot see {missing[0]}: source and output must be on a filesystem "
                             "every Ray node mounts at the same path")


# retried by the driver (RayExecutor._launch), which says so
@ray.remote(num_cpus=1, max_retries=0)
def _convert_unit_task(unit: dict, paths: dict[str, str], out_dir: str, progress, version: str) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _check_node(paths, out_dir, version)
    rep = _Reporter(progress, job_key(unit))
    try:
        return run_job(unit, paths, out_dir, progress=rep, remote=True)
    finally:
        rep.flush(wait=True)


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__).strip()


def _cause(exc: BaseException) -> BaseException:
    """What a task raised (a RayTaskError wraps it), or the system error itself (a lost worker or node)."""
    return exc.cause if isinstance(exc, rex.RayTaskError) and getattr(exc, "cause", None) is not None else exc


def transient(exc: BaseException) -> bool:
    """Whether a task's failure may pass on another attempt: its worker or node went away, or an OSError
    (a flaky mount); a KimiQuantError (a damaged source, another version on a node) is deterministic."""
    cause = _cause(exc)
    return isinstance(cause, SYSTEM_ERRORS) or (isinstance(cause, OSError) and not isinstance(cause, KimiQuantError))


def unit_failure(file: str, exc: BaseException, attempts: int = MAX_RETRIES + 1) -> BaseException:
    """The exception the driver sees for a unit whose Ray task failed for good (after ``attempts``)."""
    cause = _cause(exc)
    if isinstance(cause, KimiQuantError):  # deterministic: never retried
        cls = type(cause)
        msg = f"unit {file} failed after 1 attempt: {one_line(cause)}"
        try:
            err = cls(msg)
        except Exception:  # noqa: BLE001 - a subclass with another constructor
            err = KimiQuantError(msg)
    elif transient(cause):
        what = one_line(cause) if isinstance(cause, OSError) else f"{type(cause).__name__}: {one_line(cause)}"
        err = KimiQuantError(f"unit {file} failed after {attempts} attempt{'s' if attempts > 1 else ''}: {what}")
    elif isinstance(cause, rex.TaskCancelledError):
        return cause
    else:  # a bug: keep the remote traceback (RayTaskError carries it) and name the unit
        if hasattr(exc, "add_note"):
            exc.add_note(f"while converting unit {file} on Ray")
        return exc
    err.__cause__ = cause
    return err


def check_reachable(address: str, timeout: float = PROBE_SECONDS, origin: str = "") -> None:
    """Raise a one-line KimiQuantError unless ``address`` accepts a TCP connection within ``timeout``.

    ``ray.init`` never fails on an unreachable or refusing GCS: it retries for minutes, printing
    warnings. 'auto' and 'local' are resolved or started by Ray on this machine and are not probed.
    ``origin`` names where the address came from (RAY_ADDRESS), for a user who forgot it is set.
    """
    src = f" (from {origin})" if origin else ""
    if address in ("auto", "local"):
        return
    hostport = address[len("ray://"):] if address.startswith("ray://") else address
    try:
        parts = urlsplit("//" + hostport)
        host, port = parts.hostname, parts.port  # .port raises ValueError on a bad number
        ok = bool(host) and port is not None and parts.netloc == hostport  # no scheme, path or query left
    except ValueError:
        ok = False
    if not ok:
        raise KimiQuantError(f"Ray address {address!r}{src} does not parse: expected HOST:PORT (e.g. 10.0.0.5:6379), "
                             "ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return
    except TimeoutError:
        why = f"connection timed out after {timeout:g} s"
    except ConnectionRefusedError:
        why = "connection refused: nothing listens on that port"
    except socket.gaierror as e:
        why = f"cannot resolve host {host!r}: {e.strerror or e}"
    except OSError as e:
        why = e.strerror or str(e)
    raise KimiQuantError(f"cannot reach the Ray cluster at {address}{src} ({why}): is `ray start --head` running there "
                         "and the port open?")


def connect(address: str | None, workers: int | None, object_store: int | None = LOCAL_OBJECT_STORE) -> bool:
    """``start_or_join`` unless this process is connected already; True when this call started Ray (its
    caller shuts it down again)."""
    if ray.is_initialized():
        return False
    start_or_join(address, workers, object_store)
    return True


def start_or_join(address: str | None, workers: int | None, object_store: int | None = LOCAL_OBJECT_STORE) -> None:
    """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``, or one running on this machine), else start a
    local one with ``workers`` CPUs and ``object_store`` bytes of object store (None: Ray's default)."""
    # Ray puts the driver's working directory on every worker's import path, ahead of site-packages
    # (a numba.py in the directory kimi-quant was run from would run in every task), unless the job
    # has a working_dir: give it an empty one (uploaded once at init; tasks get absolute paths only).
    empty = tempfile.mkdtemp(prefix="kimi-quant-ray-")
    try:
        _init_in(address, workers, object_store, dict(logging_level=logging.WARNING, configure_logging=True,
                                                      runtime_env={"working_dir": empty}))
    finally:
        os.rmdir(empty)


def _init_in(address: str | None, workers: int | None, object_store: int | None, quiet: dict) -> None:
    env = os.environ.get("RAY_ADDRESS")
    target = env if env and address in (None, "auto") else address  # Ray lets RAY_ADDRESS stand in for these
    if target:
        check_reachable(target, origin="" if target == address else "RAY_ADDRESS")
    try:
        if address or os.environ.get("RAY_ADDRESS"):
            ray.init(address=address, **quiet)
            return
        try:  # a cluster already running on this machine (ray start --head)
            ray.init(address="auto", **quiet)
            return
        except ConnectionError:
            pass
        ray.init(num_cpus=workers or None, include_dashboard=False, object_store_memory=object_store, **quiet)
    except ConnectionError as e:
        raise KimiQuantError(f"cannot reach the Ray cluster at {address or os.environ.get('RAY_ADDRESS')}: "
                             f"{one_line(e)}") from e


class RayExecutor(Executor):
    remote = True  # workers may be on other nodes: a split shard is hashed and renamed by a task, not the driver

    def __init__(self, workers: int | None = None, on_progress: Callable[[int], None] | None = None,
                 address: str | None = None, **_ignored):
        self.on_progress = on_progress or (lambda n: None)
        self._closed = False
        self._owns_ray = connect(address, workers)
        cpus = int(ray.cluster_resources().get("CPU", 0))
        self.slots = max(1, int(workers) if workers else cpus)
        self._actor = _Progress.remote()
        self._refs: dict = {}  # ObjectRef -> unit file, while outstanding
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._drain = threading.Thread(target=self._drain_progress, name="ray-progress", daemon=True)
        self._drain.start()

    # -- progress -----------------------------------------------------------------------------
    def _take(self, timeout: float = 10.0) -> None:
        n = ray.get(self._actor.take.remote(), timeout=timeout)
        if n:
            self.on_progress(n)

    def _drain_progress(self) -> None:
        while not self._stop.wait(FLUSH_SECONDS):
            try:
                self._take()
            except Exception:  # noqa: BLE001 - progress is cosmetic; shutdown drains the rest
                continue

    # -- executor contract ----------------------------------------------------------------------
    def submit(self, unit: dict, paths: dict[str, str], out_dir: str) -> Future:
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        self._launch(unit, dict(paths), str(out_dir), fut, 1)
        return fut

    def _launch(self, unit: dict, paths: dict[str, str], out_dir: str, fut: Future, attempt: int) -> None:
        """Attempt ``attempt`` of a unit's task; a transient failure launches the next one, saying so."""
        file = unit["file"]
        ref = _convert_unit_task.remote(unit, paths, out_dir, self._actor, __version__)
        with self._lock:
            self._refs[ref] = file

        def done(rf: Future) -> None:
            with self._lock:
                self._refs.pop(ref, None)
            try:
                fut.set_result(rf.result())
                return
            except BaseException as e:  # noqa: BLE001 - delivered to the driver through the future
                err = e
            if transient(err) and attempt <= MAX_RETRIES and not self._closed:
                cause = _cause(err)
                log.warning("kimi-quant: warning: the Ray task converting %s failed (%s: %s); retrying it "
                            "(attempt %d of %d)", file, type(cause).__name__, one_line(cause), attempt + 1,
                            MAX_RETRIES + 1)
                try:
                    self._launch(unit, paths, out_dir, fut, attempt + 1)
                    return
                except Exception:  # noqa: BLE001 - the cluster went away: this attempt's error stands
                    pass
            fut.set_exception(unit_failure(file, err, attempt))

        ref.future().add_done_callback(done)

    def shutdown(self, abort: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            outstanding = list(self._refs)
        if abort and outstanding:
            # First a KeyboardInterrupt in each running task, then a kill for whatever has not stopped
            # within a few seconds. No task creates a file (the driver created and has already removed
            # this run's temporary files), so even a killed one leaves nothing behind.
            for force, grace in ((False, 5), (True, 10)):
                for ref in outstanding:
                    try:
                        ray.cancel(ref, force=force)
                    except Exception:  # noqa: BLE001 - already finished or its node is gone
                        pass
                _, outstanding = ray.wait(outstanding, num_returns=len(outstanding), timeout=grace)
                if not outstanding:
                    break
        self._stop.set()
        self._drain.join(timeout=5)
        try:
            self._take()  # progress still pending in the actor
            ray.kill(self._actor)
        except Exception:  # noqa: BLE001
            pass
        if self._owns_ray:  # stops a cluster we started; for a joined one this only disconnects
            ray.shutdown()
