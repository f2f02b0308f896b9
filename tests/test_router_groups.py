"""The validate router against transformers' own DeepSeek-V3 / Kimi Linear router modules.

Group-limited routing (``num_expert_group`` > 1) changes which experts a token reaches; the
reference forward must pick exactly the experts the model's own code picks, with the same weights.
"""

import subprocess
import sys

import pytest
import torch

from kimi_quant.errors import KimiQuantError
from kimi_quant.model.presets import preset_config
from kimi_quant.model.spec import spec_from_config
from kimi_quant.runtime import forward as fw
from kimi_quant.runtime.supported import check_supported

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter  # noqa: E402
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig  # noqa: E402
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter  # noqa: E402

torch.set_num_threads(1)
H = 64


def _our_cfg(E, G, TG, K, renorm=True, scale=2.5, **extra):
    text = {**preset_config("tiny")["text_config"], "hidden_size": H, "num_experts": E, "num_expert_group": G,
            "topk_group": TG, "num_experts_per_token": K, "moe_renormalize": renorm,
            "routed_scaling_factor": scale, **extra}
    return spec_from_config({**preset_config("tiny"), "text_config": text}).text


def _hf_router(kind, E, G, TG, K, renorm, scale):
    common = dict(hidden_size=H, num_experts_per_tok=K, n_group=G, topk_group=TG, norm_topk_prob=renorm,
                  routed_scaling_factor=scale)
    if kind == "deepseek_v3":
        return DeepseekV3TopkRouter(DeepseekV3Config(n_routed_experts=E, **common))
    return KimiLinearTopkRouter(KimiLinearConfig(num_local_experts=E, **common))


# (experts, groups, kept groups, top-k): DeepSeek-V3's shape scaled down, Kimi's trivial grouping,
# every group kept, one kept group holding exactly k experts, and many small groups
SETTINGS = [(16, 4, 2, 4), (64, 8, 4, 8), (64, 8, 3, 6), (16, 1, 1, 4), (32, 4, 4, 8), (12, 3, 1, 4), (48, 16, 5, 6)]


@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_linear"])
@pytest.mark.parametrize("E,G,TG,K", SETTINGS)
@pytest.mark.parametrize("renorm", [True, False])
def test_router_matches_transformers(kind, E, G, TG, K, renorm):
    scale = 2.5
    gen = torch.Generator().manual_seed(E * 1000 + G * 10 + TG)
    router = _hf_router(kind, E, G, TG, K, renorm, scale)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen) * 0.2)
        # a correction bias as large as the score spread, so the biased choice differs from the plain one
        router.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.3)
        x = torch.randn(400, H, generator=gen)
        _, hf_w, hf_idx = router(x)
    cfg = _our_cfg(E, G, TG, K, renorm, scale)
    idx, wts = fw.route(cfg, router.weight.detach(), router.e_score_correction_bias, x)
    ours = [dict(zip(i.tolist(), w.tolist())) for i, w in zip(idx, wts)]
    theirs = [dict(zip(i.tolist(), w.tolist())) for i, w in zip(hf_idx, hf_w)]
    same = sum(set(a) == set(b) for a, b in zip(ours, theirs))
    assert same == len(x), f"{same}/{len(x)} tokens got the same experts"
    for a, b in zip(ours, theirs):
        for e in a:
            assert a[e] == pytest.approx(b[e], rel=1e-6, abs=1e-7)


def test_groups_change_the_choice():
    """The setting matters: with 4 groups of which 2 are kept, plain top-k picks other experts for
    most tokens (so the comparison above is not passing by accident)."""
    gen = torch.Generator().manual_seed(0)
    W, bias, x = torch.randn(16, H, generator=gen) * 0.2, torch.randn(16, generator=gen) * 0.3, torch.randn(200, H, generator=gen)
    grouped, _ = fw.route(_our_cfg(16, 4, 2, 4), W, bias, x)
    plain, _ = fw.route(_our_cfg(16, 1, 1, 4), W, bias, x)
    differ = sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(grouped, plain))
    assert differ > 50, differ
    # every chosen expert lies in at most topk_group = 2 groups
    assert all(len({e // 4 for e in row.tolist()}) <= 2 for row in grouped)


@pytest.mark.parametrize("extra,needle", [
    ({"moe_router_activation_func": "softmax"}, "router scoring 'softmax'"),
    ({"scoring_func": "softmax", "moe_router_activation_func": None}, "router scoring 'softmax'"),
    ({"topk_method": "group_limited_greedy"}, "topk_method 'group_limited_greedy'"),
    ({"num_expert_group": 3}, "num_expert_group 3 (must divide num_experts 16)"),
    ({"num_expert_group": 4, "topk_group": 5}, "topk_group 5"),
    ({"num_expert_group": 8, "topk_group": 1}, "num_expert_group 8 / topk_group 1"),
    ({"num_expert_group": 4, "topk_group": 2, "use_grouped_topk": False}, "use_grouped_topk false"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mla_use_nope": False}, "mla_use_nope false"),
    ({"moe_layer_freq": 2}, "moe_layer_freq 2"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings true"),
])
def test_unsupported_settings_are_refused(extra, needle):
    cfg = _our_cfg(16, 1, 1, 4, **extra)
    with pytest.raises(KimiQuantError, match="cannot run this model as configured") as ei:
        check_supported(cfg)
    assert needle in str(ei.value) and "\n" not in str(ei.value)


def test_supported_presets_pass():
    for name in ("tiny", "bench", "full"):
        check_supported(spec_from_config(preset_config(name)).text)
    check_supported(_our_cfg(64, 8, 4, 8, n_group=8))


@pytest.mark.parametrize("command", ["validate", "convert"])
def test_cli_refuses_unsupported_router_in_one_line(tmp_path, command):
    """The command line: one `kimi-quant: error:` line before any layer runs, and `convert --validate`
    refuses before converting anything."""
    import json
    import shutil
    from importlib import resources

    src = tmp_path / "src"
    shutil.copytree(resources.files("kimi_quant.model") / "fixtures" / "tiny", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["moe_router_activation_func"] = "softmax"
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    args = ["validate", str(src), str(src), "--quiet"] if command == "validate" else \
        ["convert", str(src), "--target", "a3", "--output", str(out), "--validate", "--quiet"]
    r = subprocess.run([sys.executable, "-m", "kimi_quant.cli", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kimi-quant: error:") and "router scoring 'softmax'" in err[0], r.stderr
    assert not out.exists()
