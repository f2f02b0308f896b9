"""Bounded memory of the calibrated path and the truth of ``plan --calibrate``: float32 Hessians above
FLOAT64_MAX_K handed over without a copy, the in-place Cholesky, the worker-memory formula against a
measured GPTQ job, the wall-time estimate against a measured calibrated convert of the tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kimi_quant.calibrate import CalibConfig
from kimi_quant.calibrate import estimate as est
from kimi_quant.calibrate import hessian as hmod
from kimi_quant.synth import synth

ROOT = Path(__file__).resolve().parents[1]


def test_float32_hessian_above_the_limit_is_summed_in_place_and_handed_over_without_a_copy(monkeypatch):
    monkeypatch.setattr(hmod, "FLOAT64_MAX_K", 4)
    rng = np.random.default_rng(0)
    xs = [torch.from_numpy(rng.standard_normal((3, 7, 8)).astype(np.float32)) for _ in range(3)]
    c = hmod.HessianCollector()
    c.want(["a", "b"])
    for x in xs:
        c("a", x)
        c("b", x)  # shared input: one sum
    flat = np.concatenate([x.reshape(-1, 8).double().numpy() for x in xs])
    want = flat.T @ flat / len(flat)
    h = c.hessian("a")
    assert h.dtype == np.float32 and c.held_bytes == 8 * 8 * 4 == hmod.hessian_bytes(8)
    np.testing.assert_allclose(h, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.shares_memory(h, c.hessian("b"))  # the sum itself, divided once
    np.testing.assert_array_equal(c.hessian("b"), h)
    with pytest.raises(RuntimeError, match="after its Hessian was handed out"):
        c("a", torch.zeros(2, 8))
    c.drop(["a", "b"])
    assert c.held_bytes == 0
    small = hmod.HessianCollector()  # at or below the limit: float64, divided into a new array, which the
    small.want(["s", "t"])           # Linears sharing that input are handed together; the sum stays as it was
    x = torch.ones(2, 4)
    small("s", x)
    small("t", x)  # the same input object: one sum
    hs = small.hessian("s")
    assert hs.dtype == np.float64 and np.shares_memory(hs, small.hessian("t"))
    small("s", 3 * torch.ones(2, 4))  # a float64 sum may still grow: its hand-out was a copy
    np.testing.assert_array_equal(hs, np.ones((4, 4)))
    np.testing.assert_array_equal(small.hessian("s"), np.full((4, 4), 5.0))


@pytest.mark.parametrize("K,panel", [(1, 4), (37, 8), (300, 64), (600, 1024)])
def test_cholesky_in_place_matches_torch_and_reads_only_the_lower_triangle(K, panel):
    from kimi_quant.quant.gptq_factor import cholesky_in_place

    g = torch.Generator().manual_seed(K)
    X = torch.randn(K, K + 5, generator=g)
    A = X @ X.T / K + 0.1 * torch.eye(K)
    ref = torch.linalg.cholesky(A)
    B = A.clone()
    iu = torch.triu_indices(K, K, 1)
    B[iu[0], iu[1]] = 7.0
    assert cholesky_in_place(B, panel) == 0
    assert float((B - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert bool((B[iu[0], iu[1]] == 0).all())
    bad = torch.eye(K)
    bad[K // 2, K // 2] = -1.0
    assert cholesky_in_place(bad, panel) == int(torch.linalg.cholesky_ex(torch.diag(torch.diagonal(bad))).info)


def test_hessian_key_separates_stages():
    """An attention input and an MLP input of one layer with the same width are two Hessians."""
    from kimi_quant.calibrate.layered import ATTENTION, MLP

    a = est._hessian_key("l.0.attn.q", 0, ATTENTION, -1, 64, True)
    m = est._hessian_key("l.0.mlp.gate", 0, MLP, -1, 64, True)
    assert a != m
    assert est._hessian_key("l.0.mlp.up", 0, MLP, -1, 64, True) == m  # gate/up share one
    assert est._hessian_key("l.0.mlp.down", 0, MLP, -1, 64, False) != m


def test_worker_memory_formula_covers_a_measured_gptq_job():
    """scripts/measure_gptq_memory.py's child: the peak resident set of one GPTQ job (float64 and float32
    Hessians) stays under ``worker_bytes``, and not by more than 2x."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from measure_gptq_memory import measure
    finally:
        sys.path.pop(0)
    for N, K in ((256, 1024), (128, 9216)):
        peak = measure(N, K, "W8A8_DYNAMIC", "down")["peak"]
        assert peak <= est.worker_bytes(N, K) <= 2 * peak, (N, K, peak, est.worker_bytes(N, K))


@pytest.fixture(scope="module")
def tiny_a3(tmp_path_factory):
    """The tiny synthetic model: its directory, its calibrated a3 plan and its model spec."""
    from kimi_quant.convert import build_plan
    from kimi_quant.model.spec import load_model_spec_from_source
    from kimi_quant.source import open_source

    src_dir = synth("tiny", tmp_path_factory.mktemp("tiny") / "tiny")
    src = open_source(str(src_dir))
    try:
        return src_dir, build_plan(src, "a3", None, (), 4 * 1024**3, 0, calibrated=True), \
            load_model_spec_from_source(src, recipe_given=True)
    finally:
        src.close()


@pytest.mark.skipif(os.getloadavg()[0] > 2 * (os.cpu_count() or 1),
                    reason="the machine is loaded: wall time says nothing about the estimate")
def test_plan_time_is_within_2x_of_a_measured_calibrated_convert(tiny_a3, tmp_path):
    src_dir, plan, spec = tiny_a3
    tokens = 2048
    e = est.estimate(plan, spec, CalibConfig(tokens=tokens), workers=1)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kimi_quant.cli", "convert", str(src_dir), "-t", "a3", "-o",
                        str(tmp_path / "out"), "--calibrate", "--tokens", str(tokens), "--workers", "1", "-q"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    measured = time.perf_counter() - t
    assert r.returncode == 0, r.stderr
    print(f"tiny a3 --calibrate {tokens} tokens: estimated {e['wall_seconds']:.1f} s, measured {measured:.1f} s")
    assert measured / 2 <= e["wall_seconds"] <= measured * 2


def test_the_forward_is_estimated_on_the_threads_the_run_gives_it_and_all_expert_tokens_cost_more(tiny_a3):
    from kimi_quant.calibrate.run import forward_threads

    _, plan, spec = tiny_a3
    routed = est.estimate(plan, spec, CalibConfig(tokens=2048), workers=2)
    assert routed["driver_threads"] == forward_threads("local", 2)  # what run_calibrated gives its forward
    assert routed["forward_s"] * routed["driver_threads"] == pytest.approx(routed["forward_core_h"] * 3600)
    k, E = spec.text.num_experts_per_token, spec.text.num_experts
    assert routed["expert_tokens"] == "routed" and routed["expert_tokens_mean"] == 2048 * k / E
    every = est.estimate(plan, spec, CalibConfig(tokens=2048, expert_tokens="all"), workers=2)
    assert every["expert_tokens"] == "all" and every["expert_tokens_mean"] == 2048
    # the experts' jobs form their Hessians and w2's input from E/k x the tokens; the driver's share is the same
    assert every["job_gflop"] == pytest.approx(routed["job_gflop"] * E / k)
    assert every["hessian_gflop"] == routed["hessian_gflop"] and every["forward_gflop"] == routed["forward_gflop"]


def test_a_described_driver_sets_the_forward_threads_and_caps_local_workers(tiny_a3):
    """plan --driver-cores: the forward runs on min(workers, the driver's cores) threads, local GPTQ workers
    are capped at those cores (Ray workers are not), and the forward's core-hours are spread over those threads."""
    src_dir, plan, spec = tiny_a3
    cfg = CalibConfig(tokens=512)
    ray = est.estimate(plan, spec, cfg, workers=1024, executor="ray", driver_cores=64)
    assert ray["driver_threads"] == 64 and ray["gptq_workers"] == 1024
    local = est.estimate(plan, spec, cfg, workers=1024, executor="local", driver_cores=8)
    assert local["driver_threads"] == 8 and local["gptq_workers"] == 8
    for e, threads in ((ray, 64), (local, 8)):
        assert e["forward_s"] * threads == pytest.approx(e["forward_core_h"] * 3600)
    r = subprocess.run([sys.executable, "-m", "kimi_quant.cli", "plan", str(src_dir), "-t", "a3", "--driver-cores", "8"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode != 0 and "--driver-cores sizes a calibrated run" in r.stderr


def test_int4_from_a_packed_mxfp4_source_is_costed_at_its_own_gptq_rate(monkeypatch):
    """convert --calibrate runs more GPTQ on such a tensor (gptq.for_mxfp4_weights): the estimate probes that
    config on an MXFP4-grid matrix, and only for int4 per channel from a packed source."""
    from kimi_quant.plan import TensorPlan

    def tp(scheme, packed, group=0):
        return TensorPlan("w", "f", "MXFP4" if packed else "BF16", [64, 128], scheme, "gate", [], group,
                          [["c", "f"], ["s", "f"]] if packed else None)

    assert est.job_kind(tp("W4A8_DYNAMIC", True)) == "W4A8_DYNAMIC" + est.MXFP4_KIND
    assert est.job_kind(tp("W4A8_DYNAMIC", False)) == "W4A8_DYNAMIC"
    assert est.job_kind(tp("W4A8_DYNAMIC", True, 64)) == "W4A8_DYNAMIC"
    assert est.job_kind(tp("W8A8_DYNAMIC", True)) == "W8A8_DYNAMIC"
    from kimi_quant.quant import gptq
    from kimi_quant.quant import numerics as nm

    seen = []
    monkeypatch.setattr(gptq, "gptq_quantize", lambda codec, w, matmul, h, cfg: seen.append((codec.name, w, cfg)))
    est._gptq_seconds("W4A8_DYNAMIC", "gate", 8, 64)
    est._gptq_seconds("W4A8_DYNAMIC" + est.MXFP4_KIND, "gate", 8, 64)
    (name0, w0, cfg0), (name1, w1, cfg1) = seen
    assert name0 == name1 == "W4A8_DYNAMIC"
    assert cfg0 == gptq.GPTQConfig() and cfg1 == gptq.for_mxfp4_weights(gptq.GPTQConfig()) != cfg0
    assert not nm.on_mxfp4_grid(w0) and nm.on_mxfp4_grid(w1)


def test_under_routed_share_is_the_binomial_tail():
    from math import comb

    for T, p, floor in ((64, 0.1, 5), (300, 0.03, 9), (2048, 16 / 896, 32), (10, 0.5, 0)):
        exact = sum(comb(T, j) * p ** j * (1 - p) ** (T - j) for j in range(min(floor, T + 1)))
        assert est.under_routed_share(T, p, floor) == pytest.approx(exact, rel=1e-9, abs=1e-300)
    assert est.under_routed_share(8192, 16 / 896, 32) < 1e-20  # K3.1 Pro at the defaults, balanced routing


def test_plan_counts_the_all_token_pass_of_under_routed_mxfp4_experts(tiny_a3, tmp_path):
    """a3 --calibrate from the released layout: routed experts under --min-expert-tokens get an all-token
    pass; the estimate adds its expected share (balanced routing) and states the worst case; a BF16 source has none."""
    from kimi_quant.convert import build_plan
    from kimi_quant.model.spec import load_model_spec_from_source
    from kimi_quant.source import open_source

    src = open_source(str(synth("tiny", tmp_path / "released", experts="mxfp4")))
    try:
        plan = build_plan(src, "a3", None, (), 4 * 1024**3, 0, calibrated=True)
        spec = load_model_spec_from_source(src, recipe_given=True)
    finally:
        src.close()
    t = spec.text
    moe_layers = t.num_hidden_layers - t.first_k_dense_replace
    few = est.estimate(plan, spec, CalibConfig(tokens=256, min_expert_tokens=64), workers=1)
    assert few["all_token_experts"] == moe_layers * t.num_experts
    share = est.under_routed_share(256, t.num_experts_per_token / t.num_experts, 64)
    assert few["under_routed_share"] == pytest.approx(share) and 0.1 < share < 1
    none = est.estimate(plan, spec, CalibConfig(tokens=256, min_expert_tokens=0), workers=1)
    assert none["under_routed_share"] == 0 and none["all_token_worst_s"] > 0
    # the flops added: that share of every such expert's job on every token's rows (its Hessians and w2's input);
    # the driver's forward and Hessians do none of it
    jobs, *_ = est._jobs_and_hessians(est._linears(plan, spec), t, CalibConfig(tokens=256), 32)
    extra = [est._expert_job_flops(j.members, 256) - j.flops for js in jobs.values() for j in js if j.expert]
    assert len(extra) == few["all_token_experts"] and min(extra) > 0
    assert few["job_gflop"] - none["job_gflop"] == pytest.approx(share * sum(extra) / 1e9)
    assert few["forward_gflop"] == none["forward_gflop"] and few["hessian_gflop"] == none["hessian_gflop"]
    every = est.estimate(plan, spec, CalibConfig(tokens=256, expert_tokens="all"), workers=1)
    assert every["all_token_experts"] == 0  # --expert-tokens all already observes every expert on every token
    _, bf16_plan, bf16_spec = tiny_a3
    assert est.estimate(bf16_plan, bf16_spec, CalibConfig(tokens=256), workers=1)["all_token_experts"] == 0


def test_the_forward_runs_in_passes_of_at_most_pass_tokens(tiny_a3, tmp_path, monkeypatch):
    """More calibration tokens than PASS_TOKENS are more passes of the forward, not larger ones: the windows come
    in batches of at most that many tokens (the same token ids, so the same digest), plan's forward transient
    grows only by the MoE's latent input and output (the experts' jobs take their rows from all of it), and the
    run converts."""
    from kimi_quant.calibrate import config as calib_config
    from kimi_quant.calibrate.run import calibration_windows
    from kimi_quant.convert import ConvertOptions, convert
    from kimi_quant.source import open_source
    from kimi_quant.verify import verify_output

    src_dir, plan, spec = tiny_a3
    src = open_source(str(src_dir))
    try:
        one, info_one = calibration_windows(src, CalibConfig(tokens=2048))
        monkeypatch.setattr(calib_config, "PASS_TOKENS", 1024)
        two, info_two = calibration_windows(src, CalibConfig(tokens=2048))
    finally:
        src.close()
    assert [tuple(b.shape) for b in one] == [(4, 512)] and [tuple(b.shape) for b in two] == [(2, 512), (2, 512)]
    assert info_one == info_two  # the same windows and token digest
    t = spec.text
    small, large = (est.driver_bytes(spec, CalibConfig(tokens=n), 0, 0, 0) for n in (1024, 8192))
    assert large["state"] == 8 * small["state"]
    assert large["forward"] - small["forward"] <= 2 * (8192 - 1024) * (t.latent_size or t.hidden_size) * 4
    out = tmp_path / "passes"
    res = convert(str(src_dir), ConvertOptions(target="a3", output=out, quiet=True, workers=1,
                                               calibrate=CalibConfig(tokens=2048)))
    assert res.calibration["windows"] == 4 and res.calibration["stats"]["gptq_tensors"] > 0
    verify_output(out)


def test_with_ray_the_forward_of_more_passes_is_spread_over_actors_and_their_memory_stated(tiny_a3, monkeypatch):
    """plan models the data-parallel forward as the run does it (``config.partitions``: one Ray actor per pass, on
    the CPU): the forward's core-seconds over the actors' cores (at most the cluster's), the driver holding a
    layer's routed experts as written for them, each actor its pass's state, forward and weights."""
    from kimi_quant.calibrate import config as calib_config

    _, plan, spec = tiny_a3
    monkeypatch.setattr(calib_config, "PASS_TOKENS", 512)
    cfg = CalibConfig(tokens=2048)
    assert calib_config.passes(cfg) == 4
    assert [calib_config.partitions(c, x) for c, x in ((cfg, "ray"), (cfg, "local"), (CalibConfig(tokens=512), "ray"),
                                                       (CalibConfig(tokens=2048, device="cuda"), "ray"))] == [4, 1, 1, 1]
    local = est.estimate(plan, spec, cfg, workers=64, executor="local", driver_cores=8)
    ray = est.estimate(plan, spec, cfg, workers=64, executor="ray", driver_cores=8)
    assert local["forward_partitions"] == 1 and local["partition_memory_bytes"] == 0
    assert ray["forward_partitions"] == 4 and ray["forward_core_h"] == pytest.approx(local["forward_core_h"], rel=0.2)
    assert local["forward_s"] * 8 == pytest.approx(local["forward_core_h"] * 3600)  # the driver's 8 threads
    assert ray["forward_s"] * 32 == pytest.approx(ray["forward_core_h"] * 3600)  # 4 actors x 8, within 64 cores
    few = est.estimate(plan, spec, cfg, workers=16, executor="ray", driver_cores=8)
    assert few["forward_s"] * 16 == pytest.approx(few["forward_core_h"] * 3600)  # the cluster's 16 cores bound them
    written = ray["driver_memory"]["written_experts"]
    assert written > 0 and ray["driver_memory_bytes"] > written
    # the driver checkpoints the actors' state one pass at a time (of 4): it holds a quarter of x and the blocks
    assert ray["driver_memory"]["state"] * 4 < local["driver_memory"]["state"]
    assert ray["driver_memory"]["forward"] < local["driver_memory"]["forward"]
    assert written / 2 < ray["partition_memory_bytes"]
