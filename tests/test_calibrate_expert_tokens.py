"""--expert-tokens routed|all: with ``all`` every routed expert's Hessian sees every token of its layer's input
while the layer's output still follows the router; the run reports the fewest / median tokens an expert's
Hessian saw; the setting is bound to the output (a re-run with another value is refused, naming it)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kimi_quant.calibrate import CalibConfig
from kimi_quant.calibrate.hessian import HessianCollector
from kimi_quant.calibrate.jobs import ExpertJob, run_expert_job
from kimi_quant.calibrate.routed import Routing
from kimi_quant.convert import ConvertOptions, convert
from kimi_quant.layout.ascend_v1 import PROVENANCE
from kimi_quant.runtime import forward as fw
from kimi_quant.synth import synth
from kimi_quant.verify import verify_output

from conftest import error_line, kq, refused_calibrated_resume, snapshot

torch.set_num_threads(1)
TOKENS = 512


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return synth("tiny", tmp_path_factory.mktemp("etsrc") / "tiny-bf16")


def _moe(E=4, k=1, R=16, I=8):
    g = torch.Generator().manual_seed(1)
    cfg = SimpleNamespace(num_experts=E, num_experts_per_token=k, num_expert_group=1, topk_group=1,
                          moe_renormalize=True, routed_scaling_factor=1.0, routed_expert_hidden_size=0,
                          hidden_act="silu", num_shared_experts=0)
    bias = torch.zeros(E)
    bias[E - 1] = -1e4  # the last expert is never routed to
    w = {"block_sparse_moe.gate.weight": torch.randn(E, R, generator=g), "block_sparse_moe.gate.e_score_correction_bias": bias}
    for e in range(E):
        for n, shape in (("w1", (I, R)), ("w3", (I, R)), ("w2", (R, I))):
            w[f"block_sparse_moe.experts.{e}.{n}.weight"] = torch.randn(*shape, generator=g)
    xs = [torch.randn(1, 24, R, generator=g), torch.randn(2, 10, R, generator=g)]
    return cfg, w, xs


def _observed(cfg, w, xs):
    """The routed forward observed by the driver's collector, and the routing it hands back."""
    coll = HessianCollector()
    names = [n for n in w if ".experts." in n]
    coll.want(names)
    batches = []
    with fw.observe_linear_inputs(coll):
        ys = fw.moe_many(cfg, w, xs, routing=batches)
    return ys, coll, Routing(batches)


def _hessians(cfg, w, routing, e, every):
    W1, W3 = (w[f"block_sparse_moe.experts.{e}.{n}.weight"].numpy() for n in ("w1", "w3"))
    return ExpertJob("e", (), routing.rows(e, every), W1, W3, cfg).hessians()


def test_an_expert_job_forms_the_collectors_hessians_from_its_routed_rows_bit_for_bit():
    cfg, w, xs = _moe()
    ys, coll, routing = _observed(cfg, w, xs)
    plain = fw.moe_many(cfg, w, xs)
    assert all(torch.equal(a, b) for a, b in zip(ys, plain))  # handing back the routing changes nothing
    T = sum(x.shape[0] * x.shape[1] for x in xs)
    counts = routing.tokens_per_expert(cfg.num_experts)
    assert routing.tokens == T and sum(counts) == T and counts[3] == 0  # top-1; expert 3 is never routed to
    for e in range(3):
        assert counts[e] == coll.tokens(f"block_sparse_moe.experts.{e}.w1.weight") > 0
        h_in, h_mid = _hessians(cfg, w, routing, e, every=False)
        assert np.array_equal(h_in, coll.hessian(f"block_sparse_moe.experts.{e}.w1.weight"))
        assert np.array_equal(h_mid, coll.hessian(f"block_sparse_moe.experts.{e}.w2.weight"))
    assert routing.rows(3, every_token=False) == ()  # and its job would be refused: nothing reaches it
    with pytest.raises(ValueError, match="no token rows"):
        run_expert_job(ExpertJob("e3", (), (), np.zeros((8, 16), np.float32), np.zeros((8, 16), np.float32), cfg))


def test_every_token_rows_give_the_hessians_of_the_whole_input():
    cfg, w, xs = _moe()
    _, _, routing = _observed(cfg, w, xs)
    T = sum(x.shape[0] * x.shape[1] for x in xs)
    z = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs])  # w1's input: every token (no latent projection)
    want = (z.double().t() @ z.double() / T).numpy()
    for e in range(cfg.num_experts):  # the never-routed expert too
        h_in, h_mid = _hessians(cfg, w, routing, e, every=True)
        np.testing.assert_allclose(h_in, want, rtol=1e-5, atol=1e-6)
        W1, W3 = (w[f"block_sparse_moe.experts.{e}.{n}.weight"] for n in ("w1", "w3"))
        he = torch.nn.functional.silu(z @ W1.t()) * (z @ W3.t())
        np.testing.assert_allclose(h_mid, (he.double().t() @ he.double() / T).numpy(), rtol=1e-5, atol=1e-6)


def _convert(source, out, expert_tokens):
    return convert(str(source), ConvertOptions(target="a3", output=Path(out), quiet=True, workers=1, calibrate=CalibConfig(
        tokens=TOKENS, expert_tokens=expert_tokens))).calibration


def test_all_tokens_calibrates_every_expert_and_reports_the_tokens(source, tmp_path):
    routed = _convert(source, tmp_path / "routed", "routed")
    s = routed["stats"]
    assert "expert_tokens" not in routed  # the default leaves the recorded settings as they were
    assert 0 <= s["expert_tokens_min"] <= s["expert_tokens_median"] < TOKENS

    every = _convert(source, tmp_path / "all", "all")
    s = every["stats"]
    assert every["expert_tokens"] == "all"
    assert s["expert_tokens_min"] == s["expert_tokens_median"] == TOKENS
    assert s["fallback_experts"] == s["never_routed_experts"] == 0 and s["routed_experts"] == 80
    assert s["gptq_tensors"] >= routed["stats"]["gptq_tensors"]
    verify_output(tmp_path / "all")
    shards = lambda out: {k: v for k, v in snapshot(out).items() if k.startswith("quant_model_weights-")}  # noqa: E731
    assert shards(tmp_path / "all") != shards(tmp_path / "routed")
    prov = json.loads((tmp_path / "all" / PROVENANCE).read_text())["calibration"]
    assert prov["stats"]["expert_tokens_min"] == TOKENS
    from kimi_quant.layout.model_card import describe_calibration

    assert f"min {TOKENS} / median {TOKENS} tokens (every token" in describe_calibration(prov)
    assert f"median {routed['stats']['expert_tokens_median']} tokens" in describe_calibration(routed)


def test_resume_with_another_expert_tokens_is_refused_naming_it(source, tmp_path):
    line, args = refused_calibrated_resume(source, tmp_path / "out", ("--tokens", "256", "--expert-tokens", "all"),
                                           ("--tokens", "256"))
    assert "--expert-tokens all" in line, line
    assert args[args.index("--expert-tokens") + 1] == "all"
    r = kq("convert", source, "-t", "a3", "-o", tmp_path / "x", "--expert-tokens", "all")
    assert r.returncode == 2 and "only with --calibrate" in error_line(r.stderr)


def test_plan_states_the_tokens_per_expert(source):
    r = kq("plan", source, "-t", "a3", "--calibrate", "--tokens", "4096", "--no-shards", "--expert-tokens", "all")
    assert r.returncode == 0, r.stderr
    assert "min = median = 4096" in r.stdout
    r = kq("plan", source, "-t", "a3", "--calibrate", "--tokens", "4096", "--no-shards")
    assert r.returncode == 0, r.stderr
    assert "per routed expert on average" in r.stdout and "reports both" in r.stdout
