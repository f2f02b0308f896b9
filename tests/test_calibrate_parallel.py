"""convert --calibrate with the GPTQ jobs of a layer spread over runners (calibrate/jobs.py, ray_jobs.py):
the same bytes in one process, in 2 local worker processes and as Ray tasks on 2 workers; a killed worker's
jobs are redone to the same bytes; an interrupted parallel run resumes to the same bytes; a job that fails
stops the run with one line naming its tensor."""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kimi_quant.calibrate import CalibConfig
from kimi_quant.calibrate import jobs as calib_jobs
from kimi_quant.calibrate import run as calib_run
from kimi_quant.convert import ConvertOptions, convert
from kimi_quant.errors import BadCheckpoint, KimiQuantError
from kimi_quant.model.spec import load_model_spec
from kimi_quant.quant.gptq import GPTQConfig
from kimi_quant.synth import synth
from kimi_quant.verify import verify_output

from conftest import kill_the_first, small_moe, snapshot

torch.set_num_threads(1)
TOKENS = 1024  # 2 windows of 512: most tiny experts see >= 32 tokens; a run takes seconds


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return synth("tiny", tmp_path_factory.mktemp("parsrc") / "tiny-bf16")


def _convert(source, out, workers: int, executor: str = "local", expert_batch: int | None = None, seq_len: int = 512):
    cfg = CalibConfig(tokens=TOKENS, expert_batch=expert_batch, seq_len=seq_len)
    return convert(str(source), ConvertOptions(target="a3", output=Path(out), quiet=True, workers=workers,
                                               executor=executor, calibrate=cfg))


@pytest.fixture(scope="module")
def serial(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serial") / "a3"
    res = _convert(source, out, workers=1)
    assert res.calibration["stats"]["gptq_tensors"] > 200  # attention, MLP and experts all went through GPTQ
    return out


def test_two_local_workers_write_the_same_bytes(serial, source, tmp_path, monkeypatch):
    made, forward_threads = [], []
    real = calib_run.make_runner
    real_set = torch.set_num_threads

    def make_runner(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    def set_num_threads(n):  # the driver's forward runs on the run's cores, GPTQ's stages on one thread
        forward_threads.append(n)
        real_set(n)

    monkeypatch.setattr(calib_run, "make_runner", make_runner)
    monkeypatch.setattr(calib_run.torch, "set_num_threads", set_num_threads)
    stages = []
    real_run = calib_jobs.ProcessRunner.run
    monkeypatch.setattr(calib_jobs.ProcessRunner, "run", lambda self, jobs: real_run(self, stages.append(1) or jobs))
    out = tmp_path / "two"
    _convert(source, out, workers=2, expert_batch=3)  # the experts in stages of 3: more stages, the same bytes
    assert isinstance(made[0], calib_jobs.ProcessRunner) and made[0].workers == 2
    assert max(forward_threads) == min(2, os.cpu_count() or 1) and forward_threads[-1] == 1
    assert snapshot(out) == snapshot(serial)
    verify_output(out)
    t = load_model_spec(source).text
    assert len(stages) >= (t.num_hidden_layers - t.first_k_dense_replace) * -(-t.num_experts // 3)


def test_experts_per_stage_follow_the_workers_and_leave_the_bytes_alone():
    assert [CalibConfig().experts_per_stage(w) for w in (1, 2, 100, 1024)] == [32, 32, 100, 256]
    assert CalibConfig(expert_batch=7).experts_per_stage(1024) == 7
    assert CalibConfig(expert_batch=7).describe() == CalibConfig().describe()  # not in the fingerprint


def test_forward_threads_are_the_cores_the_run_was_given():
    cores = os.cpu_count() or 1
    assert calib_run.forward_threads("local", 1) == 1
    assert calib_run.forward_threads("local", 2) == min(2, cores)
    assert calib_run.forward_threads("ray", 1024) == cores
    assert calib_run.forward_threads("local", None) == cores


def test_the_forwards_products_do_not_depend_on_the_thread_count():
    """What byte-identical output for any --workers rests on, at a routed expert's real width (3584) and widths
    torch splits over threads: the MoE forward's outputs and every Hessian, bit for bit, on 1 and 2 threads."""
    from kimi_quant.calibrate.hessian import HessianCollector
    from kimi_quant.runtime import forward as fw

    cfg, w, xs = small_moe(3584, 512, 3, 384)
    got = {}
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            coll = HessianCollector()
            names = [k for k in w if ".experts." in k]
            coll.want(names)
            with fw.observe_linear_inputs(coll):
                ys = fw.moe_many(cfg, w, xs)
            got[n] = (ys, {k: coll.hessian(k) for k in names})
    finally:
        torch.set_num_threads(threads)
    (y1, h1), (y2, h2) = got[1], got[2]
    assert all(torch.equal(a, b) for a, b in zip(y1, y2))
    assert h1.keys() == h2.keys() and all(np.array_equal(h1[k], h2[k]) for k in h1)


class _KillOne(calib_jobs.ProcessRunner):
    """Kills one of its workers (SIGKILL, as the OOM killer would) once, in the middle of a layer's jobs."""

    killed = 0

    def run(self, jobs):
        for k, out in enumerate(super().run(jobs)):
            if k == 3 and not _KillOne.killed and self.pids():
                os.kill(self.pids()[0], signal.SIGKILL)
                _KillOne.killed += 1
            yield out


def test_a_killed_worker_has_its_jobs_redone_to_the_same_bytes(serial, source, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(calib_run, "make_runner", lambda *a, **k: _KillOne(2))
    out = tmp_path / "killed"
    with caplog.at_level(logging.WARNING):
        _convert(source, out, workers=2)
    assert _KillOne.killed == 1
    said = [r.getMessage() for r in caplog.records if "GPTQ worker process died" in r.getMessage()]
    assert len(said) == 1 and "redoing" in said[0], said
    assert snapshot(out) == snapshot(serial)


class _Interrupt(BaseException):
    pass


def test_interrupted_parallel_run_resumes_to_the_same_bytes(serial, source, tmp_path, monkeypatch):
    out = tmp_path / "resumed"
    real_put, n = calib_run.UnitWriter.put, {"puts": 0}

    def put(self, t, quantized=None):
        n["puts"] += 1
        if n["puts"] == 150:  # inside layer 2
            raise _Interrupt()
        return real_put(self, t, quantized)

    monkeypatch.setattr(calib_run.UnitWriter, "put", put)
    with pytest.raises(_Interrupt):
        _convert(source, out, workers=2)
    assert (out / calib_run.STATE_FILE).exists()
    assert not (out / "quant_model_description.json").exists()
    monkeypatch.setattr(calib_run.UnitWriter, "put", real_put)
    _convert(source, out, workers=2)
    assert snapshot(out) == snapshot(serial)


def _job(name: str, weight: np.ndarray) -> calib_jobs.GPTQJob:
    k = weight.shape[1]
    return calib_jobs.GPTQJob(name, "expert", "W8A8_DYNAMIC", 0, False, None, weight, np.eye(k), GPTQConfig())


@pytest.mark.parametrize("runner", [calib_jobs.SerialRunner, lambda: calib_jobs.ProcessRunner(2)],
                         ids=["serial", "processes"])
def test_a_failing_job_stops_the_run_with_one_line_naming_its_tensor(runner):
    rng = np.random.default_rng(0)
    good = rng.standard_normal((8, 64)).astype(np.float32)
    bad = good.copy()
    bad[3, 5] = np.nan
    with runner() as r:
        results = r.run([_job("layers.0.good", good), _job("layers.0.bad", bad), _job("layers.0.after", good)])
        first = next(results)
        assert first and all(isinstance(a, np.ndarray) for a in first.values())  # the good job's outputs
        with pytest.raises(BadCheckpoint) as e:
            next(results)
    msg = str(e.value)
    assert "layers.0.bad" in msg and "\n" not in msg


def _expert(name: str, w3: np.ndarray) -> calib_jobs.ExpertJob:
    """A routed expert's job (R 64, I 32) with ``w3`` as its up projection, given 40 token rows."""
    rng = np.random.default_rng(1)
    w1, w2 = rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((64, 32)).astype(np.float32)
    jobs = tuple(replace(_job(f"{name}.{n}.weight", w), matmul=m, hessian=None)
                 for n, m, w in (("w1", "gate", w1), ("w2", "down", w2), ("w3", "up", w3)))
    rows = (rng.standard_normal((40, 64)).astype(np.float32),)
    return calib_jobs.ExpertJob(name, jobs, rows, w1, w3, SimpleNamespace(hidden_act="silu"))


@pytest.mark.parametrize("runner", [calib_jobs.SerialRunner, lambda: calib_jobs.ProcessRunner(2)],
                         ids=["serial", "processes"])
def test_an_expert_job_gives_a_result_per_linear_and_a_failing_one_names_its_tensor(runner):
    good = np.random.default_rng(2).standard_normal((32, 64)).astype(np.float32)
    bad = good.copy()
    bad[7, 1] = np.nan
    serial = list(calib_jobs.SerialRunner().run([_expert("experts.0", good)]))
    with runner() as r:
        results = r.run([_expert("experts.0", good), _expert("experts.1", bad), _job("layers.0.after", good)])
        got = [next(results) for _ in range(3)]  # w1, w2, w3 of the good expert, in its order
        assert all(a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a) for a, b in zip(got, serial))
        assert [g["weight"].shape for g in got] == [(32, 64), (64, 32), (32, 64)]
        with pytest.raises(BadCheckpoint) as e:
            next(results)
    msg = str(e.value)
    assert "experts.1.w3.weight" in msg and "\n" not in msg


# -- Ray ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kimi-quant[ray]')")
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    if ray.is_initialized():
        pytest.skip("a Ray session is already open in this process")
    # one GPU declared (Ray takes it as a resource: nothing here opens it), no NPU
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()
    if old is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = old


def test_ray_with_two_workers_writes_the_same_bytes(cluster, serial, source, tmp_path):
    out = tmp_path / "ray"
    _convert(source, out, workers=2, executor="ray")
    assert snapshot(out) == snapshot(serial)
    assert cluster.is_initialized()  # a cluster it joined is left running


PASSES = 4  # calibration passes of the data-parallel tests: windows of TOKENS / 4, one per pass


@pytest.fixture
def in_passes(monkeypatch):
    """Within a test: PASSES passes of the calibration tokens (``convert`` in this process)."""
    from kimi_quant.calibrate import config as calib_config

    monkeypatch.setattr(calib_config, "PASS_TOKENS", TOKENS // PASSES)
    return lambda source, out, **k: _convert(source, out, seq_len=TOKENS // PASSES, **k)


@pytest.fixture
def local_passes(in_passes, source, tmp_path) -> Path:
    out = tmp_path / "local"
    in_passes(source, out, workers=1)
    return out


def test_ray_forward_over_token_passes_writes_the_same_bytes(cluster, source, tmp_path, monkeypatch, in_passes,
                                                             local_passes):
    """With more tokens than one pass, Ray runs the forward data-parallel: each pass in an actor of its own, its
    Hessians replayed into the driver's sums in pass order. The bytes are those of the forward in the driver."""
    from kimi_quant.calibrate import ray_forward

    made = []
    real = ray_forward.RayForward

    class Counted(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append((self.partitions, self.threads))

    monkeypatch.setattr(ray_forward, "RayForward", Counted)
    out = tmp_path / "ray"
    in_passes(source, out, workers=2, executor="ray")
    # 4 actors on this one node share its cores: one thread each, not the driver's count each
    assert made == [(PASSES, [max(1, min(2, (os.cpu_count() or 1) // PASSES))] * PASSES)]
    assert snapshot(out) == snapshot(local_passes)
    verify_output(out)


def test_a_lost_forward_actor_is_said_and_its_layer_redone_to_the_same_bytes(cluster, source, tmp_path, in_passes,
                                                                            local_passes, caplog):
    """A forward actor killed (as its node dying would lose it) mid-layer: one warning naming the pass, the work
    since the last layer checkpointed redone in new actors, and the bytes and counts of an undisturbed run."""
    out = tmp_path / "ray"
    with kill_the_first("ray::_Passes.output") as killed, caplog.at_level(logging.WARNING):
        res = in_passes(source, out, workers=2, executor="ray")
    assert len(killed) == 1
    said = [m.getMessage() for m in caplog.records if "was lost" in m.getMessage()]
    assert len(said) == 1 and "Ray actor holding calibration pass" in said[0] and "attempt 2 of 4" in said[0], said
    assert snapshot(out) == snapshot(local_passes)
    want = json.loads((local_passes / "kimi_quant_provenance.json").read_text())["calibration"]["stats"]
    assert res.calibration["stats"] == want  # the redone layer counted once


def test_an_actor_lost_after_a_checkpoint_redoes_only_the_layers_since(cluster, source, tmp_path, in_passes,
                                                                       local_passes, monkeypatch, caplog):
    """An actor killed in layer 1 (layer 0 checkpointed): the run goes on from the checkpoint, not from the
    embedding, and writes the bytes of an undisturbed run."""
    from kimi_quant.calibrate import ray_forward

    outputs, starts = [], []
    real_output, real_start = ray_forward.RayForward.output, calib_run._starting_point

    def output(self, i, *a):
        outputs.append(i)
        if len(outputs) == 2:  # layer 1's output: its actor dies as its node would
            cluster.kill(self._actors[1])
        return real_output(self, i, *a)

    def starting_point(*a):
        got = real_start(*a)
        starts.append(got[0])
        return got

    monkeypatch.setattr(ray_forward.RayForward, "output", output)
    monkeypatch.setattr(calib_run, "_starting_point", starting_point)
    out = tmp_path / "ray"
    with caplog.at_level(logging.WARNING):
        in_passes(source, out, workers=2, executor="ray")
    assert outputs[:3] == [0, 1, 1] and starts == [0, 1]
    assert sum("pass 2 of 4 was lost" in m.getMessage() for m in caplog.records) == 1
    assert snapshot(out) == snapshot(local_passes)


def test_ray_failing_job_is_one_line(cluster):
    from kimi_quant.calibrate.ray_jobs import RayRunner

    bad = np.ones((8, 64), np.float32)
    bad[0, 0] = np.inf
    with RayRunner(2) as r:
        with pytest.raises(BadCheckpoint) as e:
            list(r.run([_job("layers.1.w2", bad)]))
    assert "layers.1.w2" in str(e.value) and "\n" not in str(e.value)


def test_ray_lost_task_is_redone_to_the_same_bytes_and_said(cluster, caplog):
    """A Ray worker killed while it runs a GPTQ task (as a node that dies would lose it): the driver submits the
    task again, says so in one warning, and the results are those of an undisturbed run."""
    from kimi_quant.calibrate.ray_jobs import RayRunner

    rng = np.random.default_rng(0)
    jobs = [_job(f"layers.1.experts.{e}.w1", rng.standard_normal((1024, 2048)).astype(np.float32)) for e in range(3)]
    with RayRunner(2) as r:
        want = list(r.run(jobs))
    with kill_the_first("ray::_gptq_task") as killed, caplog.at_level(logging.WARNING), RayRunner(2) as r:
        got = list(r.run(jobs))
    assert len(killed) == 1
    said = [m.getMessage() for m in caplog.records if "was lost" in m.getMessage()]
    assert len(said) == 1 and "layers.1.experts." in said[0] and "redoing it (attempt 2 of 4)" in said[0], said
    assert len(got) == len(want) == 3
    assert all(a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a) for a, b in zip(want, got))


def test_ray_tasks_on_a_device_share_the_cluster_devices_and_a_cluster_without_one_is_refused(cluster):
    """With --device cuda each task holds a share of one of the cluster's GPUs (so two workers share the one
    declared here and run to the same results); --device npu on a cluster with no NPU is one line before any task
    is submitted (Ray would keep such tasks pending for ever)."""
    from kimi_quant.calibrate.ray_jobs import RayRunner

    rng = np.random.default_rng(3)
    jobs = [_job(f"layers.1.experts.{e}.w1", rng.standard_normal((64, 128)).astype(np.float32)) for e in range(4)]
    with RayRunner(2) as r:
        want = list(r.run(jobs))
    with RayRunner(2, device="cuda") as r:
        assert r.task_options == {"num_gpus": 0.5}
        got = list(r.run(jobs))
    assert all(a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a) for a, b in zip(want, got))
    with pytest.raises(KimiQuantError) as e:
        RayRunner(2, device="npu")
    msg = str(e.value)
    assert "no NPU" in msg and "--device cpu" in msg and "\n" not in msg
    assert cluster.is_initialized()  # a refused runner leaves the cluster it joined running


def test_device_share_spreads_tasks_evenly_over_the_devices():
    from kimi_quant.calibrate.ray_jobs import device_share

    assert device_share("cpu", 64, {"CPU": 64}) == {}
    assert device_share("cuda", 64, {"CPU": 64, "GPU": 8}) == {"num_gpus": 0.125}
    assert device_share("cuda", 4, {"CPU": 64, "GPU": 8}) == {"num_gpus": 1.0}  # fewer tasks than devices
    assert device_share("cuda", 3, {"GPU": 1}) == {"num_gpus": 0.3333}  # 3 x 0.3333 fits in one
    assert device_share("npu", 32, {"NPU": 16}) == {"resources": {"NPU": 0.5}}
    with pytest.raises(KimiQuantError, match="no GPU"):
        device_share("cuda", 2, {"CPU": 2})


def test_a_run_this_machine_cannot_hold_is_refused_or_given_fewer_default_workers(serial, source, tmp_path,
                                                                                 monkeypatch, caplog):
    """Before the output is touched, plan's memory accounting against this machine's memory: the default
    workers shrink to the most that fit (saying so, same bytes); explicit workers that do not fit, or a driver that
    does not, are refused in one line and leave no output directory."""
    from kimi_quant.calibrate import estimate as est
    from kimi_quant.calibrate.estimate import memory
    from kimi_quant.calibrate.run import calibrated_plan
    from kimi_quant.convert import build_plan
    from kimi_quant.executor import fork_server
    from kimi_quant.source import open_source

    src = open_source(str(source))
    try:
        plan, _ = calibrated_plan(src, build_plan(src, "a3", None, (), 4 * 1024**3, 0, calibrated=True),
                                  CalibConfig(tokens=TOKENS))
    finally:
        src.close()
    spec = load_model_spec(source)
    need = memory(plan, spec, CalibConfig(tokens=TOKENS))
    peak = {n: need(n)["peak"] for n in (1, 2, 3)}
    assert peak[1] < peak[2] < peak[3]
    monkeypatch.setattr(fork_server, "default_workers", lambda: 3)
    monkeypatch.setattr(est, "machine_memory_bytes", lambda: (peak[2] + peak[3]) // 2)
    made = []
    real = calib_run.make_runner
    monkeypatch.setattr(calib_run, "make_runner", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    with caplog.at_level(logging.WARNING):
        _convert(source, tmp_path / "fit", workers=None)
    assert made[-1].workers == 2 and "3 workers would need" in caplog.text and "using 2" in caplog.text
    assert snapshot(tmp_path / "fit") == snapshot(serial)
    for workers, have, says in ((3, (peak[2] + peak[3]) // 2, "use fewer --workers"),
                                (None, peak[1] // 2, "fewer --tokens")):
        monkeypatch.setattr(est, "machine_memory_bytes", lambda have=have: have)
        out = tmp_path / f"refused-{workers}"
        with pytest.raises(KimiQuantError, match=says) as e:
            _convert(source, out, workers=workers)
        assert "\n" not in str(e.value) and "of memory here" in str(e.value) and not out.exists()


@pytest.mark.parametrize("float32_sums", [False, True], ids=["float64", "float32-in-place"])
def test_recorded_passes_replayed_in_order_give_the_collectors_hessians_bit_for_bit(source, float32_sums,
                                                                                      monkeypatch):
    """What the data-parallel forward rests on: a layer's sections observed per pass by Recorders (as the Ray
    actors do) and replayed in pass order give the very sums of one collector observing every pass (float64,
    before GPTQ rounds them away; or, as above FLOAT64_MAX_K, float32 sums accumulated in place, where the order
    of the passes shows in the bits), and the same routed rows."""
    from kimi_quant.calibrate import hessian
    from kimi_quant.calibrate.hessian import HessianCollector, Recorder
    from kimi_quant.calibrate.token_parts import TokenPart
    from kimi_quant.runtime import forward as fw
    from kimi_quant.runtime.weights import EMBED_NAMES, SourceLoader

    loader = SourceLoader(source)
    t = load_model_spec(source).text
    gw, _ = loader.globals(EMBED_NAMES)
    torch.manual_seed(0)
    ids = [torch.randint(0, t.vocab_size, (2, 64)) for _ in range(4)]
    states = [fw.embed(gw, b) for b in ids]
    i = t.first_k_dense_replace  # a MoE layer: attention, latent projections, shared experts, routing
    w, _ = loader.layer(i)
    names = [n for n in w if n.endswith(".weight") and w[n].dim() == 2 and "experts." not in n.split("shared")[0]]

    if float32_sums:
        monkeypatch.setattr(hessian, "FLOAT64_MAX_K", 8)  # every sum of the tiny model's Linears in float32
    whole, want = TokenPart(t, list(states)), set(names)
    coll = HessianCollector()
    coll.want(want)
    whole.attention(i, w, coll)
    routing = whole.mlp(i, w, coll)

    replayed, rows = HessianCollector(), []
    replayed.want(want)
    for st in states:
        part, rec = TokenPart(t, [st]), Recorder(want)
        part.attention(i, w, rec)
        rows += part.mlp(i, w, rec)
        replayed.replay(rec.records)
    seen = [n for n in names if coll.tokens(n)]
    assert len(seen) > 5 and [replayed.tokens(n) for n in seen] == [coll.tokens(n) for n in seen]
    for n in seen:
        h = coll.hessian(n)
        assert h.dtype == (np.float32 if float32_sums else np.float64)
        assert np.array_equal(h, replayed.hessian(n)), n
    assert len(rows) == len(routing) == 4
    assert all(torch.equal(a, b) for r1, r2 in zip(rows, routing) for a, b in zip(r1, r2))
