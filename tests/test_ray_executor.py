"""The Ray executor on a real local Ray cluster: same bytes as the local executor, resume across
executors, and a failing unit stops the run with one line naming its shard.

One module-scoped cluster (2 CPUs, ~5 s to start); skipped when Ray is not installed
(pip install 'kimi-quant[ray]').
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kimi-quant[ray]')")

from kimi_quant.convert import ConvertOptions, build_plan, convert  # noqa: E402
from kimi_quant.errors import BadCheckpoint, KimiQuantError  # noqa: E402
from kimi_quant.synth import synth  # noqa: E402
from kimi_quant.source import open_source  # noqa: E402
from kimi_quant.source.safetensors import SafetensorsReader  # noqa: E402

JOURNAL = "kimi_quant_journal.jsonl"
SHARD = 200_000  # small output shards: the tiny model becomes ~12 units
TARGET = "950dt"


@pytest.fixture(scope="module")
def cluster():
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    if ray.is_initialized():
        pytest.skip("a Ray session is already open in this process")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    if old is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = old


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return synth("tiny", tmp_path_factory.mktemp("ray-src") / "src", random_weights=True)


def _convert(src, out, executor, **kw):
    return convert(str(src), ConvertOptions(target=TARGET, output=Path(out), executor=executor, quiet=True,
                                            max_shard_size=SHARD, workers=kw.pop("workers", None), **kw))


def snapshot(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file() and p.name != JOURNAL}


def journal_units(d: Path) -> dict[str, tuple]:
    evs = [json.loads(ln) for ln in (d / JOURNAL).read_text().splitlines()]
    return {e["file"]: (e["size"], e["sha256"]) for e in evs if e["kind"] == "unit"}


@pytest.fixture(scope="module")
def local_out(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ray-local") / "out"
    _convert(src, out, "local", workers=1)
    return out


@pytest.mark.parametrize("part_bytes", [None, 1], ids=["default-parts", "a-part-per-tensor"])
def test_ray_output_is_byte_identical_to_local(cluster, src, local_out, tmp_path, part_bytes):
    res = _convert(src, tmp_path / "ray", "ray", **({"part_bytes": part_bytes} if part_bytes else {}))
    assert res.converted_units == len(res.plan.units) >= 6
    assert snapshot(tmp_path / "ray") == snapshot(local_out)
    assert journal_units(tmp_path / "ray") == journal_units(local_out)
    assert ray.is_initialized(), "the executor must not shut down a Ray session it did not start"


def _crash_partway(out: Path, drop: list[str]) -> None:
    """Make ``out`` look like a run killed part-way: ``drop`` shards never finished (one left as
    a torn .partial), no metadata files yet, no 'complete' event."""
    lines = [ln for ln in (out / JOURNAL).read_text().splitlines()
             if json.loads(ln)["kind"] != "complete" and json.loads(ln).get("file") not in drop]
    (out / JOURNAL).write_text("\n".join(lines) + "\n")
    for f in drop:
        (out / f).unlink()
    (out / (drop[0] + ".partial")).write_bytes(b"torn")
    for p in out.iterdir():
        if not p.name.startswith("quant_model_weights-") and p.name != JOURNAL and not p.name.endswith(".partial"):
            p.unlink() if p.is_file() else shutil.rmtree(p)


def test_resume_across_executors(cluster, src, local_out, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(local_out, out)
    units = sorted(journal_units(local_out))
    # started locally, crashed; resumed on Ray
    _crash_partway(out, units[::2])
    res = _convert(src, out, "ray")
    assert (res.converted_units, res.reused_units) == (len(units[::2]), len(units) - len(units[::2]))
    assert snapshot(out) == snapshot(local_out)
    # ... and the other way round: a Ray run that crashed, resumed locally
    _crash_partway(out, units[1::2])
    res = _convert(src, out, "local", workers=1)
    assert res.converted_units == len(units[1::2])
    assert snapshot(out) == snapshot(local_out)
    assert journal_units(out) == journal_units(local_out)


def _quantized_tensor_and_unit(src: Path) -> tuple[str, str, str]:
    source = open_source(str(src))
    try:
        plan = build_plan(source, TARGET, max_shard_size=SHARD)
    finally:
        source.close()
    for u in plan.units:
        for t in u.tensors:
            if t.scheme != "FLOAT" and t.dtype == "BF16":
                return t.name, t.file, u.file
    raise AssertionError("no quantized tensor in the plan")


def _corrupt(src: Path, dst: Path) -> tuple[str, str, str]:
    """Copy ``src`` to ``dst`` with one BF16 NaN in a tensor that gets quantized; returns
    (tensor, source file, output unit)."""
    shutil.copytree(src, dst)
    name, file, unit = _quantized_tensor_and_unit(dst)
    with SafetensorsReader(dst / file) as r:
        start = r.info(name).start
    with open(dst / file, "r+b") as f:
        f.seek(start)
        f.write(np.array([0x7FC0], "<u2").tobytes())
    return name, file, unit


def test_a_lost_task_is_retried_to_the_same_bytes_and_said(cluster, tmp_path, caplog):
    """A Ray worker killed while it converts a unit (as a node that dies would lose it): the driver submits the unit
    again, says so in one warning naming the shard, and the output is the local executor's, byte for byte."""
    import logging

    from conftest import MID_TEXT, kill_the_first, make_checkpoint

    mid = make_checkpoint(tmp_path / "mid", MID_TEXT)  # units that take long enough to be caught running
    _convert(mid, tmp_path / "local", "local", workers=1)
    with kill_the_first("ray::_convert_unit_task") as killed, caplog.at_level(logging.WARNING):
        _convert(mid, tmp_path / "ray", "ray")
    assert len(killed) == 1
    said = [r.getMessage() for r in caplog.records if "Ray task converting" in r.getMessage()]
    assert len(said) == 1 and "retrying it (attempt 2 of 4)" in said[0] and "quant_model_weights-" in said[0], said
    assert snapshot(tmp_path / "ray") == snapshot(tmp_path / "local")


def test_failing_unit_stops_with_one_line_naming_its_shard(cluster, src, local_out, tmp_path):
    bad = tmp_path / "src"
    name, file, unit = _corrupt(src, bad)
    out = tmp_path / "out"
    with pytest.raises(BadCheckpoint) as ei:
        _convert(bad, out, "ray")
    msg = str(ei.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"unit {unit} failed after 1 attempt: "), msg
    assert name in msg and "NaN" in msg, msg
    assert not (out / "quant_model_description.json").exists()
    assert not list(out.glob("*.partial"))
    # repair the source and resume on the local executor: same bytes as a clean run
    shutil.copyfile(src / file, bad / file)
    res = _convert(bad, out, "local", workers=1)
    assert res.converted_units >= 1
    where = ("kimi_quant_provenance.json", "README.md")  # name the source directory, which differs here
    assert {k: v for k, v in snapshot(out).items() if k not in where} == \
        {k: v for k, v in snapshot(local_out).items() if k not in where}


def test_progress_and_missing_paths(cluster, src, tmp_path):
    from kimi_quant.executor.ray_executor import RayExecutor

    source = open_source(str(src))
    try:
        plan = build_plan(source, TARGET, max_shard_size=SHARD)
        got = []
        ex = RayExecutor(on_progress=got.append)
        assert ex.slots == 2  # the cluster's CPUs
        futs = [ex.submit(u.to_json(), {f: str(source.fetch(f)) for f in u.needs}, str(tmp_path)) for u in plan.units]
        results = [f.result(timeout=60) for f in futs]
        ex.shutdown()
        assert sum(got) == plan.in_bytes  # every input byte counted once
        assert [r["file"] for r in results] == [u.file for u in plan.units]
        # a node that cannot see a path: deterministic, not retried, says what to fix
        ex = RayExecutor()
        u = plan.units[0]
        fut = ex.submit(u.to_json(), {f: f"/nonexistent/{f}" for f in u.needs}, str(tmp_path))
        with pytest.raises(KimiQuantError) as ei:
            fut.result(timeout=60)
        ex.shutdown()
        msg = str(ei.value)
        assert msg.startswith(f"unit {u.file} failed after 1 attempt: node ") and "/nonexistent/" in msg, msg
        assert "mounts at the same path" in msg and "\n" not in msg
    finally:
        source.close()


def test_abort_cancels_outstanding_units(cluster, src, tmp_path):
    from kimi_quant.executor.ray_executor import RayExecutor

    source = open_source(str(src))
    try:
        plan = build_plan(source, TARGET, max_shard_size=SHARD)
        ex = RayExecutor()
        futs = [ex.submit(u.to_json(), {f: str(source.fetch(f)) for f in u.needs}, str(tmp_path)) for u in plan.units]
        ex.shutdown(abort=True)
        for f in futs:  # every future settles: a result, or the cancellation
            assert f.exception(timeout=30) is None or isinstance(f.exception(), ray.exceptions.TaskCancelledError)
        assert ray.is_initialized()
    finally:
        source.close()


def test_failure_translation():
    """What the driver sees for each way a task can fail for good (no cluster needed)."""
    from ray import exceptions as rex

    from kimi_quant.executor.ray_executor import MAX_RETRIES, unit_failure

    def remote(cause):
        return rex.RayTaskError("_convert_unit_task", "Traceback (most recent call last):\n  ...", cause)

    e = unit_failure("u1.safetensors", remote(BadCheckpoint("a.safetensors: tensor 'w': contains NaN or Inf")))
    assert isinstance(e, BadCheckpoint)
    assert str(e) == "unit u1.safetensors failed after 1 attempt: a.safetensors: tensor 'w': contains NaN or Inf"
    e = unit_failure("u2.safetensors", remote(OSError(5, "Input/output error")))
    assert type(e) is KimiQuantError
    assert str(e) == f"unit u2.safetensors failed after {MAX_RETRIES + 1} attempts: [Errno 5] Input/output error"
    e = unit_failure("u3.safetensors", rex.WorkerCrashedError())
    assert str(e).startswith(f"unit u3.safetensors failed after {MAX_RETRIES + 1} attempts: WorkerCrashedError: ")
    assert "\n" not in str(e)
    bug = remote(ZeroDivisionError("division by zero"))
    assert unit_failure("u4.safetensors", bug) is bug  # a bug keeps its remote traceback


def test_cli_joins_a_running_cluster(cluster, src, local_out, tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "cli"
    p = subprocess.run([sys.executable, "-m", "kimi_quant.cli", "convert", str(src), "-t", TARGET, "-o", str(out),
                        "--executor", "ray", "--ray-address", cluster, "--max-shard-size", str(SHARD), "-q"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert snapshot(out) == snapshot(local_out)
    assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 2  # the cluster is still there
    # a damaged source: exit 2 and exactly one line on stderr, naming the unit and the tensor
    name, _, unit = _corrupt(src, tmp_path / "bad")
    p = subprocess.run([sys.executable, "-m", "kimi_quant.cli", "convert", str(tmp_path / "bad"), "-t", TARGET,
                        "-o", str(tmp_path / "bad-out"), "--executor", "ray", "--ray-address", cluster,
                        "--max-shard-size", str(SHARD), "-q"], capture_output=True, text=True, timeout=120, env=env)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"kimi-quant: error: unit {unit} failed after 1 attempt: ") and name in lines[0]


# -- an address that cannot be reached: one line within seconds, never ray.init's minutes of retries ---
def _closed_port() -> int:
    with socket.socket() as s:  # bound and released: nothing listens on it now
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_refused_ray_address_is_one_line(src, tmp_path):
    port = _closed_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "kimi_quant.cli", "convert", str(src), "-t", TARGET, "-o",
                        str(tmp_path / "out"), "--executor", "ray", "--ray-address", f"127.0.0.1:{port}", "-q"],
                       capture_output=True, text=True, timeout=120, env=env)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0] == (f"kimi-quant: error: cannot reach the Ray cluster at 127.0.0.1:{port} (connection refused: "
                        "nothing listens on that port): is `ray start --head` running there and the port open?")
    assert time.monotonic() - t0 < 60


def test_unresponsive_address_times_out(monkeypatch):
    """A port whose accept queue is full drops SYNs, like a firewalled or unrouted host: the probe gives up."""
    from kimi_quant.executor.ray_executor import PROBE_SECONDS, start_or_join

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # fills the queue (never accepted)
            t0 = time.monotonic()
            with pytest.raises(KimiQuantError) as ei:
                start_or_join(f"127.0.0.1:{port}", None)
            took = time.monotonic() - t0
    assert str(ei.value) == (f"cannot reach the Ray cluster at 127.0.0.1:{port} (connection timed out after "
                             f"{PROBE_SECONDS:g} s): is `ray start --head` running there and the port open?")
    assert PROBE_SECONDS - 1 < took < PROBE_SECONDS + 5


def test_test_net_address_fails_in_seconds(monkeypatch):
    """192.0.2.1 (TEST-NET-1) is never a Ray cluster: timed out, unreachable or refused, in seconds."""
    from kimi_quant.executor.ray_executor import PROBE_SECONDS, start_or_join

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:  # a network whose proxy accepts every connection would let ray.init hang: nothing to test there
        socket.create_connection(("192.0.2.1", 6379), timeout=PROBE_SECONDS).close()
        pytest.skip("this network accepts TCP connections to 192.0.2.1 (a transparent proxy)")
    except OSError:
        pass
    t0 = time.monotonic()
    with pytest.raises(KimiQuantError, match=r"^cannot reach the Ray cluster at 192\.0\.2\.1:6379 \(") as ei:
        start_or_join("192.0.2.1:6379", None)
    assert "\n" not in str(ei.value) and time.monotonic() - t0 < PROBE_SECONDS + 5


def test_address_forms(monkeypatch):
    from kimi_quant.executor.ray_executor import check_reachable, start_or_join

    port = _closed_port()
    with pytest.raises(KimiQuantError, match=rf"^cannot reach the Ray cluster at ray://127\.0\.0\.1:{port} "
                                             r"\(connection refused"):
        check_reachable(f"ray://127.0.0.1:{port}")  # a Ray client address: its host:port is probed too
    for bad in ("10.0.0.5", "10.0.0.5:abc", "10.0.0.5:99999", "http://10.0.0.5:6379", "10.0.0.5:6379/x", "[::1"):
        with pytest.raises(KimiQuantError, match=r"does not parse: expected HOST:PORT"):
            check_reachable(bad)
    check_reachable("auto")  # found by Ray on this machine: not probed
    # RAY_ADDRESS stands in for no address (and for 'auto'), and the message says where it came from
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    for address in (None, "auto"):
        with pytest.raises(KimiQuantError, match=rf"at 127\.0\.0\.1:{port} \(from RAY_ADDRESS\) \(connection refused"):
            start_or_join(address, None)
