"""convert --calibrate --device: the forward and the Hessians run on the device through one code path
(calibrate/device.py), which on the CPU gives the CPU's bytes; on CUDA (skipped without one) the results are
close to the CPU's, not equal; plan --calibrate --device cuda says its times are CPU estimates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kimi_quant.calibrate import CalibConfig
from kimi_quant.calibrate import device as cdev
from kimi_quant.calibrate import run as calib_run
from kimi_quant.calibrate.hessian import HessianCollector
from kimi_quant.convert import ConvertOptions, convert
from kimi_quant.runtime import forward as fw
from kimi_quant.synth import synth
from kimi_quant.verify import verify_output

from conftest import small_moe, snapshot

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
TOKENS = 1024
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return synth("tiny", tmp_path_factory.mktemp("devsrc") / "tiny-bf16")


def _convert(source, out, device: str = "cpu"):
    return convert(str(source), ConvertOptions(target="a3", output=Path(out), quiet=True, workers=1,
                                               calibrate=CalibConfig(tokens=TOKENS, device=device)))


def test_device_weights_move_once_except_routed_experts():
    loads = []

    class Base(dict):
        def __getitem__(self, k):
            loads.append(k)
            return dict.__getitem__(self, k)

    base = Base({"self_attn.o_proj.weight": torch.ones(2, 2), "block_sparse_moe.experts.3.w1.weight": torch.ones(2, 2),
                 "block_sparse_moe.shared_experts.up_proj.weight": torch.ones(2, 2)})
    w = cdev.DeviceWeights(base, torch.device("cpu"))
    for _ in range(2):
        for k in base:
            assert w[k] is dict.__getitem__(base, k)  # on the CPU: the tensor itself, no copy
    assert loads.count("self_attn.o_proj.weight") == 1
    assert loads.count("block_sparse_moe.shared_experts.up_proj.weight") == 1
    assert loads.count("block_sparse_moe.experts.3.w1.weight") == 2  # a routed expert is never held
    assert set(w) == set(base) and len(w) == 3 and "self_attn.o_proj.weight" in w


def test_the_forward_on_cuda_is_full_float32_and_restores_the_settings():
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = m.allow_tf32, c.allow_tf32
    try:
        m.allow_tf32 = c.allow_tf32 = True  # a caller that allows TF32 (cuDNN's default)
        with cdev.full_float32(torch.device("cuda")):  # the flags only: no CUDA device is needed
            assert not m.allow_tf32 and not c.allow_tf32
        assert m.allow_tf32 and c.allow_tf32
        with cdev.full_float32(torch.device("cpu")):
            assert m.allow_tf32 and c.allow_tf32
    finally:
        m.allow_tf32, c.allow_tf32 = saved


def test_a_phase_waits_for_the_device_before_it_is_timed():
    import time

    from kimi_quant.calibrate.phases import Phases

    events = []

    def sync():  # a device's queued kernels, finishing
        events.append("sync")
        time.sleep(0.05)

    ph = Phases(sync)
    with ph("forward"):
        with ph("hessians"):
            events.append("issued")
    assert events == ["issued", "sync", "sync"]  # at the end of each section
    assert ph.seconds["hessians"] >= 0.05  # the wait counts in the section that issued the work
    assert ph.seconds["forward"] >= 0.05


def test_the_cpu_run_goes_through_the_device_path_and_keeps_its_bytes(source, tmp_path, monkeypatch):
    """--device cpu: every weight the forward reads comes through DeviceWeights, the states and every observed
    input are on the run's device, the Hessians are summed there; and the bytes are those of the plain run
    (tests/test_calibrate*.py pin the plain run's determinism; this pins the device path to it)."""
    wrapped, seen, states_dev = [], set(), set()
    real_dw, real_call, real_states = cdev.DeviceWeights, HessianCollector.__call__, calib_run.save_state

    class SpyWeights(real_dw):
        def __getitem__(self, rel):
            t = super().__getitem__(rel)
            wrapped.append(t.device == self.device)
            return t

    def observe(self, name, x):
        seen.add(x.device)
        return real_call(self, name, x)

    def save_state(out_dir, binding, layer, layout, passes, *a):
        states = list(passes)
        states_dev.update(t.device for s in states for t in [s.x, *s.blocks])
        return real_states(out_dir, binding, layer, layout, states, *a)

    entries = []

    def through_device(fn, at):  # a forward entry point: its weights must come through DeviceWeights
        def call(*a, **k):
            entries.append((fn.__name__, isinstance(a[at], real_dw)))
            return fn(*a, **k)
        return call

    for name, at in (("embed", 0), ("layers_attention", 2), ("layers_mlp", 2), ("moe_many", 1), ("head", 1)):
        monkeypatch.setattr(fw, name, through_device(getattr(fw, name), at))
    monkeypatch.setattr(calib_run, "DeviceWeights", SpyWeights)
    monkeypatch.setattr(HessianCollector, "__call__", observe)
    monkeypatch.setattr(calib_run, "save_state", save_state)
    got = tmp_path / "dev"
    _convert(source, got, device="cpu")
    assert len(wrapped) > 100 and all(wrapped)
    # (head runs only where lm_head is quantized: not on a3)
    assert {n for n, _ in entries} >= {"embed", "layers_attention", "layers_mlp", "moe_many"}
    assert all(ok for _, ok in entries), [n for n, ok in entries if not ok]
    assert seen == {torch.device("cpu")} and states_dev == {torch.device("cpu")}
    monkeypatch.undo()

    # the reference: the same run with the device layer taken out (plain weights, no moves)
    monkeypatch.setattr(calib_run, "DeviceWeights", lambda base, device: base)
    monkeypatch.setattr(calib_run, "states_to", lambda states, device: states)
    plain = tmp_path / "plain"
    _convert(source, plain, device="cpu")
    assert snapshot(got) == snapshot(plain)
    verify_output(got)


def test_hessians_come_back_to_the_cpu_as_numpy():
    c = HessianCollector()
    c.want(["a"])
    x = torch.randn(2, 5, 8)
    c("a", x)
    h = c.hessian("a")
    assert isinstance(h, np.ndarray) and h.dtype == np.float64 and h.shape == (8, 8)
    flat = x.reshape(-1, 8).double().numpy()
    np.testing.assert_allclose(h, flat.T @ flat / 10, rtol=1e-6, atol=1e-6)


def test_plan_for_a_device_says_its_times_are_cpu_estimates(source, tmp_path):
    """plan --calibrate --device cuda sizes a run there, also on a machine without one."""
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "kimi_quant.cli", "plan", str(source), "-t", "a3", "--calibrate",
                        "--tokens", "512", "--device", "cuda", "--json", str(out)],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "--device cuda: the forward, Hessians and GPTQ times above are CPU estimates" in r.stdout
    e = json.loads(out.read_text())["totals"]["calibrate"]
    assert e["device"] == "cuda" and e["rates_from"] == "cpu"
    d = e["driver_memory"]
    own = d["weights"] + d["state"] + d["forward"] + d["hessians"]
    assert e["device_memory_bytes"] > own > 0  # and the local workers' jobs, a context each
    assert "each Ray task holds" not in r.stdout
    r = subprocess.run([sys.executable, "-m", "kimi_quant.cli", "plan", str(source), "-t", "a3", "--calibrate",
                        "--tokens", "512", "--device", "cuda", "--executor", "ray", "--workers", "16"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "Ray puts ceil(16 / the cluster's devices) tasks on each" in r.stdout  # the share each task holds
    r = subprocess.run([sys.executable, "-m", "kimi_quant.cli", "plan", str(source), "-t", "a3", "--calibrate",
                        "--tokens", "512"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and "CPU estimates" not in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_device_bench_says_there_is_no_device_and_exits_0():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_calibrate_device.py"), "--device", "cuda"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout.strip() == "no cuda device here (torch sees none): nothing measured"


# -- on a CUDA device -----------------------------------------------------------------------------------------
@needs_cuda
def test_moe_forward_and_hessians_on_cuda_are_close_to_the_cpu():
    """The MoE forward and its Hessians on CUDA against the CPU: close (other kernels and summation orders,
    TF32 off), not bit-equal."""
    cfg, w, xs = small_moe(512, 256, 4, 256)
    names = [k for k in w if ".experts." in k]
    got = {}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for dev in (torch.device("cpu"), torch.device("cuda")):
            coll = HessianCollector()
            coll.want(names)
            with fw.observe_linear_inputs(coll):
                ys = fw.moe_many(cfg, cdev.DeviceWeights(w, dev), [x.to(dev) for x in xs])
            got[dev.type] = ([y.cpu() for y in ys], {k: coll.hessian(k) for k in names})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    (yc, hc), (yg, hg) = got["cpu"], got["cuda"]
    for a, b in zip(yc, yg):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    for k in names:
        assert (hc[k] is None) == (hg[k] is None)
        if hc[k] is not None:
            np.testing.assert_allclose(hg[k], hc[k], rtol=1e-4, atol=1e-6 * np.abs(hc[k]).max())


@needs_cuda
def test_calibrate_on_cuda_is_close_to_the_cpu_run(source, tmp_path):
    """The whole calibrated conversion with the forward, Hessians and GPTQ on CUDA: it verifies, and its
    dequantized weights are close to the CPU run's (most codes equal; not byte-equal)."""
    from kimi_quant.runtime.weights import QuantizedLoader

    cpu, gpu = tmp_path / "cpu", tmp_path / "cuda"
    _convert(source, cpu)
    _convert(source, gpu, device="cuda")
    verify_output(gpu)
    with QuantizedLoader(cpu) as a, QuantizedLoader(gpu) as b:
        wa, _ = a.layer(0, lazy_experts=False)
        wb, _ = b.layer(0, lazy_experts=False)
        assert wa.keys() == wb.keys()
        same = [float((wa[k] == wb[k]).float().mean()) for k in wa if wa[k].dim() == 2]
    assert np.mean(same) > 0.9, same


def test_a_run_the_device_cannot_hold_is_refused_or_given_fewer_default_workers(source, monkeypatch, caplog):
    """--device cuda: convert's memory check also holds the run's device memory (the driver's forward and Hessians,
    each local worker's GPTQ job and context) against the device's free memory: default workers shrink to the most
    that fit, saying so; explicit ones that do not fit, or a driver that does not, are refused in one line."""
    import logging

    from kimi_quant.calibrate import estimate as est
    from kimi_quant.calibrate.run import calibrated_plan, workers_that_fit
    from kimi_quant.convert import build_plan
    from kimi_quant.errors import KimiQuantError
    from kimi_quant.executor import fork_server
    from kimi_quant.model.spec import load_model_spec
    from kimi_quant.source import open_source

    cfg = CalibConfig(tokens=TOKENS, device="cuda")
    src = open_source(str(source))
    try:
        plan, _ = calibrated_plan(src, build_plan(src, "a3", None, (), 4 * 1024**3, 0, calibrated=True), cfg)
        need = est.memory(plan, load_model_spec(source), cfg)
        dev = {n: need(n)["device"] for n in (1, 2, 3)}
        assert dev[1] < dev[2] < dev[3] and need(1)["device_driver"] < dev[1]
        assert est.memory(plan, load_model_spec(source), CalibConfig(tokens=TOKENS))(2)["device"] == 0
        monkeypatch.setattr(fork_server, "default_workers", lambda: 3)
        monkeypatch.setattr(est, "machine_memory_bytes", lambda: 1 << 50)
        monkeypatch.setattr(cdev, "free_bytes", lambda name: (dev[2] + dev[3]) // 2)
        with caplog.at_level(logging.WARNING):
            assert workers_that_fit(src, plan, cfg, "local", None) == 2
        assert "3 workers would need" in caplog.text and "of cuda memory" in caplog.text and "using 2" in caplog.text
        for workers, free, says in ((3, (dev[2] + dev[3]) // 2, "fewer --workers"), (None, dev[1] // 2, "--device cpu")):
            monkeypatch.setattr(cdev, "free_bytes", lambda name, free=free: free)
            with pytest.raises(KimiQuantError, match=says) as e:
                workers_that_fit(src, plan, cfg, "local", workers)
            assert "\n" not in str(e.value) and "of cuda memory, the device has" in str(e.value)
    finally:
        src.close()


def test_a_device_that_cannot_be_opened_is_one_line(monkeypatch):
    """A device torch lists but cannot open (exclusive mode, held by another process): one line, before any work."""
    from kimi_quant.errors import KimiQuantError

    monkeypatch.setattr(cdev, "torch_device", lambda name: torch.device("cuda"))

    def busy(dev=None):
        raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable\nCUDA kernel errors ...")

    monkeypatch.setattr(torch.cuda, "mem_get_info", busy)
    with pytest.raises(KimiQuantError) as e:
        cdev.free_bytes("cuda")
    assert str(e.value) == ("--device cuda: the device cannot be opened (CUDA error: all CUDA-capable devices are "
                            "busy or unavailable); use --device cpu")
    assert cdev.free_bytes("cpu") is None
