"""Targets, model spec roles, recipes and plans: everything decided before any data is read."""

from __future__ import annotations

import json

import pytest

from kimi_quant.errors import KimiQuantError, RecipeError, UnsupportedTarget
from kimi_quant.model.presets import preset_config
from kimi_quant.model.spec import spec_from_config
from kimi_quant.synth import synth
from kimi_quant.plan import make_plan
from kimi_quant.recipe import load_recipe
from kimi_quant.source import LocalSource
from kimi_quant.targets import resolve_target

P = "language_model.model.layers."


@pytest.mark.parametrize("text,name", [("A3", "a3"), ("atlas-a3", "a3"), ("800i-a3", "a3"), ("950DT", "950dt"),
                                       ("ascend-950dt", "950dt"), ("Atlas 900 A3", "a3")])
def test_target_aliases(text, name):
    assert resolve_target(text).name == name


@pytest.mark.parametrize("text", ["a2", "A2", "950pr", "ascend-950PR"])
def test_unsupported_targets_refused(text):
    with pytest.raises(UnsupportedTarget, match="not yet supported"):
        resolve_target(text)


def test_roles_come_from_structure_not_substrings():
    spec = spec_from_config(preset_config("tiny"))
    assert spec.role(P + "1.block_sparse_moe.experts.3.w1.weight").matmul == "gate"
    assert spec.role(P + "1.block_sparse_moe.experts.3.w3.weight").matmul == "up"
    r = spec.role(P + "1.block_sparse_moe.experts.3.w2.weight")
    assert (r.role, r.matmul, r.layer, r.expert, r.fuse_group) == ("routed_expert.down", "down", 1, 3, "L1.experts")
    assert spec.role(P + "2.block_sparse_moe.shared_experts.down_proj.weight").matmul == "down"
    assert spec.role(P + "3.self_attn.kv_b_proj.weight").role == "mla.kv_b_proj"
    assert spec.role(P + "3.self_attn.indexer.k_norm.bias").role == "dsa.indexer_norm"
    assert spec.role("vision_tower.blocks.0.attn.qkv.weight").role == "vision"
    assert spec.role(P + "0.self_attn.q_conv1d.weight").role == "kda.conv1d"


def test_tiny_preset_has_the_documented_tensor_count():
    spec = spec_from_config(preset_config("tiny"))
    assert len(spec.expected_tensors(with_vision=False)) == 406
    roles = {spec.role(n).role for n in spec.expected_tensors()}
    assert "other" not in roles, "every tiny tensor must have a known role"


def test_indexer_is_optional_and_kimi_linear_is_recognised():
    cfg = preset_config("tiny")
    del cfg["text_config"]["index_topk"]
    names = spec_from_config(cfg).expected_tensors()
    assert not any(".indexer." in n for n in names)
    lin = spec_from_config({**preset_config("tiny")["text_config"], "model_type": "kimi_linear"})
    assert lin.prefix == "" and lin.role("model.layers.1.block_sparse_moe.experts.0.w2.weight").matmul == "down"


def test_unknown_family_lists_supported():
    with pytest.raises(KimiQuantError, match="supported: kimi_k3"):
        spec_from_config({"model_type": "llama"})


def test_recipe_matches_formats_md_table():
    a3, mx = load_recipe("a3"), load_recipe("950dt")
    cases = {
        ("x", "routed_expert.down"): ("W4A8_DYNAMIC", "W4A8_MXFP"),
        ("x", "shared_expert.gate"): ("W8A8_DYNAMIC", "W4A8_MXFP"),  # W4A8_DYNAMIC is fused-MoE only
        ("x", "kda.qkv_proj"): ("W8A8_DYNAMIC", "W8A8_MXFP8"),
        ("x", "kda.g_proj"): ("W8A8_DYNAMIC", "W8A8_MXFP8"),  # fused with q/k/v by the serving stacks
        ("x", "kda.fa_b_proj"): ("W8A8_DYNAMIC", "W8A8_MXFP8"),  # in vLLM K3's in_proj_qkvgfab
        ("x", "kda.f_b_proj"): ("FLOAT", "FLOAT"),
        ("x", "mla.q_b_proj"): ("W8A8_DYNAMIC", "W8A8_MXFP8"),
        ("x", "latent_moe.up_proj"): ("FLOAT", "FLOAT"),  # SGLang/vLLM K3 build it unquantized
        ("x", "dense_mlp.down"): ("W8A8_DYNAMIC", "W8A8_MXFP8"),
        ("x", "mla.kv_b_proj"): ("FLOAT", "FLOAT"),
        ("x", "attn.o_proj"): ("FLOAT", "FLOAT"),
        ("x", "router.gate"): ("FLOAT", "FLOAT"),
        ("x", "lm_head"): ("FLOAT", "FLOAT"),
    }
    for (name, role), (want_a3, want_mx) in cases.items():
        assert a3.scheme_for(name, role) == want_a3, role
        assert mx.scheme_for(name, role) == want_mx, role


def test_overrides_and_bad_recipes(tmp_path):
    r = load_recipe("a3", overrides=["*.layers.2.*=FLOAT"])
    assert r.scheme_for(P + "2.block_sparse_moe.experts.0.w1.weight", "routed_expert.gate") == "FLOAT"
    assert r.scheme_for(P + "1.block_sparse_moe.experts.0.w1.weight", "routed_expert.gate") == "W4A8_DYNAMIC"
    with pytest.raises(RecipeError, match="PATTERN=SCHEME"):
        load_recipe("a3", overrides=["nonsense"])
    with pytest.raises(RecipeError, match="unknown scheme"):
        load_recipe("a3", overrides=["*=W3A8"])
    bad = tmp_path / "r.toml"
    bad.write_text("[targets.a3]\ndefault = 'FLOAT'\n")
    with pytest.raises(RecipeError, match=r"no \[targets.950dt\]"):
        load_recipe("950dt", bad)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    synth("tiny", d, random_weights=True)
    return LocalSource(d)


def _plan(src, target, overrides=(), max_shard=4 << 30):
    spec = spec_from_config(src.read_json("config.json"))
    t = resolve_target(target)
    return make_plan(src, spec, load_recipe(t.name, overrides=list(overrides)), t, max_shard)


def test_plan_sizes_and_shards(tiny):
    p = _plan(tiny, "950dt", max_shard=500_000)
    assert len(p.units) > 1 and all(u.out_bytes <= 500_000 or len(u.tensors) == 1 for u in p.units)
    assert [u.file for u in p.units][0] == f"quant_model_weights-00001-of-{len(p.units):05d}.safetensors"
    assert sum(len(u.tensors) for u in p.units) == 410
    assert p.in_bytes == sum(t.in_bytes for t in p.tensors()) > 3_000_000
    assert json.loads(json.dumps(p.to_json())) == p.to_json()
    from kimi_quant.plan import Plan

    assert Plan.from_json(p.to_json()).fingerprint() == p.fingerprint()
    assert _plan(tiny, "a3").fingerprint() != _plan(tiny, "950dt").fingerprint()


@pytest.mark.parametrize("override,match", [
    ("*.layers.1.block_sparse_moe.experts.3.*=FLOAT", "fused group"),
    ("*.layers.1.input_layernorm=W4A8_MXFP", "2-D"),
    ("*.layers.0.self_attn.A_log=W8A8_DYNAMIC", "2-D"),
    ("*.layers.3.self_attn.kv_b_proj=W4A8_DYNAMIC", "gate, up and down"),
    ("*.layers.1.block_sparse_moe.gate=W4A8_MXFP", None),
])
def test_invalid_combinations_refused_before_work(tiny, override, match):
    if match is None:  # router gate [16,128]: K=128 divisible by 32, allowed
        _plan(tiny, "950dt", [override])
        return
    with pytest.raises(RecipeError, match=match):
        _plan(tiny, "950dt" if "MXFP" in override else "a3", [override])


def test_every_planned_scheme_runs_on_its_target(tiny):
    """The shipped recipe gives each target only its own family (plus FLOAT); a Recipe built in code that
    mixes families is refused by make_plan itself, naming the tensor."""
    from kimi_quant.recipe.recipe import Recipe

    for name, family in (("a3", {"W4A8_DYNAMIC", "W8A8_DYNAMIC"}), ("950dt", {"W4A8_MXFP", "W8A8_MXFP8"})):
        assert set(_plan(tiny, name).scheme_counts()) == family | {"FLOAT"}
    mixed = Recipe("mixed", "a3", "FLOAT", {"lm_head": "W8A8_MXFP8"})
    spec = spec_from_config(tiny.read_json("config.json"))
    with pytest.raises(RecipeError, match=r"tensor 'language_model.lm_head.weight': scheme W8A8_MXFP8 is not for "
                                          r"target a3 \(it takes FLOAT, W4A8_DYNAMIC, W8A8_DYNAMIC\)"):
        make_plan(tiny, spec, mixed, resolve_target("a3"))


def test_override_must_match_a_tensor_recipe_rules_need_not(tiny, tmp_path):
    with pytest.raises(RecipeError, match=r"--override 'lm_head=FLOAT': the pattern matches no tensor"):
        _plan(tiny, "a3", ["lm_head=FLOAT"])  # names carry the language_model. prefix
    recipe = tmp_path / "r.toml"
    recipe.write_text("[targets.a3]\n[[targets.a3.rules]]\npattern = 'nothing.*'\nscheme = 'FLOAT'\n")
    spec = spec_from_config(tiny.read_json("config.json"))
    plan = make_plan(tiny, spec, load_recipe("a3", recipe), resolve_target("a3"))
    assert set(plan.scheme_counts()) == {"FLOAT"}


def test_mx_needs_k_divisible_by_32(tmp_path):
    cfg = preset_config("tiny")
    from kimi_quant.model.spec import spec_from_config as sfc

    spec = sfc(cfg)
    assert spec.role(P + "1.self_attn.f_b_proj.weight").role == "kda.f_b_proj"
    # f_b_proj is [P, d] = [128, 32]: fine; b_proj [h, H] = [4, 128]: N odd-sized for int4 pairs is fine (4)
    d = tmp_path / "src"
    synth("tiny", d, random_weights=True)
    src = LocalSource(d)
    with pytest.raises(RecipeError, match="divisible by 32"):
        _plan(src, "950dt", ["vision_tower.patch_embed.proj=W8A8_MXFP8"])  # K = 3*14*14 = 588


def test_full_size_k31_inventory_plans_from_headers_only(tmp_path):
    """The real 2.8T inventory (1,100+ header-only shards, holes for data): planned, sized, nothing read."""
    from kimi_quant.convert import build_plan

    synth("full", tmp_path, shard_size=5 * 10**9, sparse=True)
    src = LocalSource(tmp_path)
    assert len(src.weight_map()) == 249876 + 4 and len({f for f in src.weight_map().values()}) > 1000
    p = build_plan(src, "950dt")
    assert 5.5e12 < p.in_bytes < 5.6e12  # ~5.56 TB of BF16
    counts = p.scheme_counts()
    assert counts["W4A8_MXFP"] == 92 * (896 * 3 + 3)  # routed + shared experts of the 92 MoE layers
    assert 0.25 < p.out_bytes / p.in_bytes < 0.30


# -- what the consumers (vLLM-Ascend, SGLang) can load, decided at plan time (issue 12) ----------------
def test_w4a8_dynamic_off_the_fused_moe_is_refused_naming_the_tensor(tiny):
    with pytest.raises(RecipeError, match=r"tensor 'language_model.model.layers.1.block_sparse_moe.shared_experts"
                                          r"\.down_proj.weight' .* W4A8_DYNAMIC is a fused-MoE \(routed expert\) "
                                          r"scheme only"):
        _plan(tiny, "a3", ["*.layers.1.block_sparse_moe.shared_experts.down_proj=W4A8_DYNAMIC"])
    with pytest.raises(RecipeError, match="fused-MoE"):
        _plan(tiny, "a3", ["*.layers.0.mlp.*=W4A8_DYNAMIC"])  # the dense MLP: gate/up/down roles, still a Linear


def test_mxfp4_needs_k_divisible_by_64_for_the_loader(tmp_path):
    """vLLM-Ascend pairs the 32-block scales of W4A8_MXFP without padding: K = 32 is refused, naming it."""
    d = tmp_path / "src"
    synth("tiny", d, random_weights=True)
    src = LocalSource(d)
    with pytest.raises(RecipeError, match=r"tensor 'language_model.model.layers.1.self_attn.f_b_proj.weight' "
                                          r"BF16\[128, 32\] cannot be W4A8_MXFP: vLLM-Ascend needs K divisible by 64"):
        _plan(src, "950dt", ["*.layers.1.self_attn.f_b_proj=W4A8_MXFP"])
    _plan(src, "950dt", ["*.layers.1.self_attn.f_b_proj=W8A8_MXFP8"])  # MXFP8 pads: K = 32 loads


@pytest.mark.parametrize("preset", ["tiny", "bench", "full"])
def test_presets_plan_with_the_default_recipe_on_both_targets(preset):
    """Every W4A8_MXFP tensor of every preset has K % 64 == 0 (tiny's expert w2 used to have K = 32)."""
    from kimi_quant.plan import loader_refusal

    spec = spec_from_config(preset_config(preset))
    for target in ("a3", "950dt"):
        recipe = load_recipe(target)
        for name, (shape, _) in spec.expected_tensors().items():
            role = spec.role(name)
            scheme = recipe.scheme_for(name, role.role)
            if scheme != "FLOAT":
                assert loader_refusal(scheme, role, shape) is None, (preset, target, name, shape)


@pytest.mark.parametrize("override", [
    "*.layers.1.self_attn.g_proj=FLOAT",  # SGLang fused_qkvg_proj = q,k,v,g
    "*.layers.1.self_attn.b_proj=FLOAT",  # vLLM K3 in_proj_qkvgfab = q,k,v,g,f_a,b
    "*.layers.3.self_attn.kv_a_proj_with_mqa=FLOAT",  # fused_qkv_a_proj = q_a + kv_a
    "*.layers.0.mlp.up_proj=FLOAT",  # gate_up_proj
    "*.layers.2.block_sparse_moe.shared_experts.gate_proj=FLOAT",
])
def test_fused_groups_share_one_scheme_overrides_included(tiny, override):
    for target in ("a3", "950dt"):
        with pytest.raises(RecipeError, match="fused group .* must share one scheme"):
            _plan(tiny, target, [override])


def test_kda_in_projections_form_one_fused_group():
    spec = spec_from_config(preset_config("tiny"))
    groups = {n: spec.role(P + f"1.self_attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj", "g_proj",
                                                                     "f_a_proj", "b_proj", "f_b_proj")}
    assert {r.fuse_group for n, r in groups.items() if n != "f_b_proj"} == {"L1.kda_in_proj"}
    assert groups["g_proj"].role == "kda.g_proj" and groups["f_b_proj"].fuse_group is None
    mla_gate = spec.role(P + "3.self_attn.g_proj.weight")  # an MLA layer's output gate is its own Linear
    assert (mla_gate.role, mla_gate.fuse_group) == ("attn.g_proj", None)


def test_description_names_each_moe_layers_expert_type(tiny):
    for target, expert_type in (("a3", "W4A8_DYNAMIC"), ("950dt", "W4A8_MXFP")):
        desc = _plan(tiny, target).description()
        layer_keys = {k: v for k, v in desc.items() if k.endswith(".experts.weight")}
        moe_layers = [i for i in range(6) if i >= 1]  # first_k_dense_replace = 1
        assert layer_keys == {f"{P}{i}.block_sparse_moe.experts.weight": expert_type for i in moe_layers}
        assert desc[f"{P}1.block_sparse_moe.experts.0.w2.weight"] == expert_type
        # an override of the experts of one layer moves that layer's key with it
    desc = _plan(tiny, "a3", ["*.layers.2.block_sparse_moe.experts.*=FLOAT"]).description()
    assert desc[f"{P}2.block_sparse_moe.experts.weight"] == "FLOAT"


def test_model_quant_type_meaning_says_a3_experts_are_int4(tiny):
    from kimi_quant.plan import model_quant_type_meaning

    p = _plan(tiny, "a3")
    line = model_quant_type_meaning(p.description()["model_quant_type"], set(p.scheme_counts()))
    assert p.description()["model_quant_type"] == "W8A8_DYNAMIC"
    assert "W4A8_DYNAMIC never counts" in line and "routed experts are W4A8_DYNAMIC" in line
    p = _plan(tiny, "950dt")
    assert model_quant_type_meaning(p.description()["model_quant_type"], set(p.scheme_counts())).startswith(
        "model_quant_type W4A8_MXFP: the highest type present")


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """The tiny model with its routed experts packed as Kimi K3 is published (MXFP4)."""
    d = tmp_path_factory.mktemp("released")
    synth("tiny", d, experts="mxfp4")
    return d


def test_a3_from_mxfp4_experts_names_the_measured_rule(released):
    """plan (and convert, and the card) say which measured a3 rule the MXFP4 experts follow and its cost;
    a BF16 source and 950dt (a repack) say nothing of it."""
    from kimi_quant import mxfp4_a3

    src = LocalSource(released)
    spec = spec_from_config(src.read_json("config.json"))
    a3 = resolve_target("a3")

    def line(**kw):
        return make_plan(src, spec, load_recipe("a3"), a3, **kw).mxfp4_experts_line(kw.get("calibrated", False))

    assert line() == mxfp4_a3.experts_line("W8A8_DYNAMIC", 0, True, False)
    assert mxfp4_a3.INT8_POW2.name in line() and f"{mxfp4_a3.INT8_POW2.heldout:.2f}x heldout" in line()
    assert mxfp4_a3.INT4_CALIBRATED.name in line(calibrated=True)
    assert f"{mxfp4_a3.INT4_CALIBRATED.pydoc:.2f}x pydoc" in line(calibrated=True)
    assert mxfp4_a3.INT4_GROUP32.name in line(group_size=32)
    assert _plan(src, "950dt").mxfp4_experts_line(False) is None
    assert _plan(LocalSource(synth("tiny", released.parent / "bf16")), "a3").mxfp4_experts_line(False) is None
    # an override to a rule not measured on such a source says so instead of quoting a number
    odd = make_plan(src, spec, load_recipe("a3", overrides=["*.block_sparse_moe.experts.*=W8A8_DYNAMIC"]), a3)
    assert "not one of the rules measured" in odd.mxfp4_experts_line(False)


def test_plan_prints_the_mxfp4_experts_rule(released):
    from conftest import kq
    from kimi_quant import mxfp4_a3

    r = kq("plan", released, "-t", "a3", "--no-shards")
    assert r.returncode == 0, r.stderr
    assert mxfp4_a3.experts_line("W8A8_DYNAMIC", 0, True, False) in r.stdout


def test_every_measured_rule_has_its_numbers_and_reason():
    from kimi_quant import mxfp4_a3

    for rule in mxfp4_a3.RULES:
        assert rule.heldout > 0.95 and rule.pydoc > 0.95 and rule.why and rule.scheme in ("W8A8_DYNAMIC", "W4A8_DYNAMIC")
    assert mxfp4_a3.rule_for("W4A8_DYNAMIC", 0, False, False) is mxfp4_a3.INT4_PER_CHANNEL
    assert mxfp4_a3.rule_for("W4A8_DYNAMIC", 0, False, True) is mxfp4_a3.INT4_CALIBRATED
    assert mxfp4_a3.rule_for("W4A8_DYNAMIC", 32, False, False) is mxfp4_a3.INT4_GROUP32
    assert mxfp4_a3.rule_for("W8A8_DYNAMIC", 0, True, True) is mxfp4_a3.INT8_POW2
    assert mxfp4_a3.rule_for("W8A8_DYNAMIC", 0, False, False) is None
