"""Our spec and reference forward against the official Kimi K3 modeling code, run on this CPU.

The official code is moonshotai/Kimi-K3's remote code as the pinned llm-compressor wheel ships it
(``consumer_sources.KIMI_K3_OFFICIAL``). Its KDA layers call flash-linear-attention's Triton kernels,
which need a GPU; here they are replaced by FLA's own torch reference of the recurrence
(``fla/ops/kda/naive.py`` of the installed fla-core, loaded from its file: importing ``fla.ops`` pulls in
Triton), with the gate, l2norm and beta steps the kernel fuses written out from FLA's code
(``naive_kda_lowerbound_gate`` in fla/ops/kda/gate.py, ``l2norm_fwd`` with eps 1e-6). FLA's two modules
the layer builds, ``ShortConvolution`` and ``FusedRMSNormGated``, are replaced by torch statements of
what they compute. Everything else (MLA, MoE, router, SiTU, attention residuals, config defaults) is
the official code itself.

The checkpoint is the bundled tiny K3.1 fixture in the layouts a K3 release may take: the config keeps
its ``index_*`` keys while the indexer tensors are gone (the official model has no DSA indexer), and
``A_log`` is stored [h] (the official module) or zero-padded to 128 (the release).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import shutil
import sys
import types
import zipfile
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import consumer_sources
from kimi_quant.errors import BadCheckpoint, KimiQuantError
from kimi_quant.model.spec import load_model_spec, spec_from_config
from kimi_quant.runtime import forward as fw
from kimi_quant.runtime.weights import EMBED_NAMES, HEAD_NAMES, SourceLoader

torch.set_num_threads(1)

FIXTURE = Path(str(resources.files("kimi_quant.model") / "fixtures" / "tiny"))
PREFIX = "language_model."
TOL = 1e-5  # max |ours - official| relative to max |official|, per block and for the logits


# ------------------------------------------------------------------------------------------------
# the official code, with FLA's torch references in place of its Triton kernels
# ------------------------------------------------------------------------------------------------
class _ShortConvolution(torch.nn.Conv1d):
    """fla.modules.ShortConvolution: depthwise causal conv over time (weight [D, 1, K], no bias), SiLU."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: str | None = "silu", **_):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, padding=kernel_size - 1,
                         bias=bias)
        assert activation in ("silu", "swish")

    def forward(self, x, cache=None, output_final_state=False, cu_seqlens=None, **_):
        assert cache is None and cu_seqlens is None  # a whole sequence, no padding: all this test runs
        y = super().forward(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
        return F.silu(y), None


class _FusedRMSNormGated(torch.nn.Module):
    """fla.modules.FusedRMSNormGated: rmsnorm(x) * weight, times sigmoid(g) (or silu(g) for "swish")."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, activation: str = "swish", **_):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps, self.activation = eps, activation

    def forward(self, x, g):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return y * (torch.sigmoid(g) if self.activation == "sigmoid" else F.silu(g))


def _kda_reference(naive):
    """``chunk_kda`` / ``fused_recurrent_kda`` with the options the official layer passes."""

    def kda(q, k, v, g, beta, A_log, dt_bias, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
            lower_bound=None, cu_seqlens=None, scale=None, **_):
        assert use_qk_l2norm_in_kernel and use_gate_in_kernel and use_beta_sigmoid_in_kernel and cu_seqlens is None
        H = g.shape[-2]
        z = g.float() + dt_bias.view(H, -1)
        A = A_log.view(H, 1).float().exp()
        g = -A * F.softplus(z) if lower_bound is None else lower_bound * torch.sigmoid(A * z)
        q, k = (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        return naive.naive_recurrent_kda(q, k, v, g, beta.sigmoid(), scale=scale, initial_state=initial_state,
                                         output_final_state=output_final_state)

    return kda


@contextlib.contextmanager
def _modules(stubs: dict[str, types.ModuleType]):
    """``stubs`` in sys.modules while the official code is imported (its module keeps what it took)."""
    saved = {n: sys.modules.get(n) for n in stubs}
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def _import_official(module: str):
    """``module`` of the official code (imported once, as package ``kimi_k3_official``)."""
    pytest.importorskip("transformers", reason="transformers is not installed (the official code is built on it)")
    if "kimi_k3_official" not in sys.modules:
        try:
            root = consumer_sources.kimi_k3_official_source()
        except consumer_sources.Unavailable as e:
            pytest.skip(str(e))
        pkg = types.ModuleType("kimi_k3_official")
        pkg.__path__ = [str(root)]
        sys.modules["kimi_k3_official"] = pkg
    # the modeling file imports one llm-compressor helper (its MoE calibration switch, off at inference)
    stubs = {}
    if importlib.util.find_spec("llmcompressor") is None:
        for name in ("llmcompressor", "llmcompressor.modeling", "llmcompressor.modeling.moe"):
            stubs[name] = types.ModuleType(name)
            stubs[name].__path__ = []
        ctx = stubs["llmcompressor.modeling.moe.context"] = types.ModuleType("llmcompressor.modeling.moe.context")
        ctx.get_calibrate_all_experts_flag = lambda: False
    with _modules(stubs):
        return importlib.import_module(f"kimi_k3_official.{module}")


@pytest.fixture(scope="module")
def official_config():
    """The official configuration module (configuration_kimi_k3.py)."""
    return _import_official("configuration_kimi_k3")


@pytest.fixture(scope="module")
def official(official_config):
    """(configuration module, modeling_kimi_linear module) of the official code, its FLA kernels replaced."""
    fla = importlib.util.find_spec("fla")
    if fla is None or not fla.submodule_search_locations:
        pytest.skip("fla-core is not installed (pip install fla-core; its torch KDA reference stands in for "
                    "the official code's Triton kernels)")
    einops = pytest.importorskip("einops", reason="einops is not installed (fla-core depends on it)")
    naive_file = Path(list(fla.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    if not naive_file.is_file():
        pytest.skip(f"this fla-core has no ops/kda/{naive_file.name} (the KDA torch reference, there in 0.5.x)")
    naive_spec = importlib.util.spec_from_file_location("fla_kda_naive_reference", naive_file)
    naive = importlib.util.module_from_spec(naive_spec)
    naive_spec.loader.exec_module(naive)
    model = _import_official("modeling_kimi_linear")
    kda = _kda_reference(naive)
    for name, value in {"rearrange": einops.rearrange, "ShortConvolution": _ShortConvolution,
                        "FusedRMSNormGated": _FusedRMSNormGated, "chunk_kda": kda, "fused_recurrent_kda": kda}.items():
        setattr(model, name, value)
    return official_config, model


# ------------------------------------------------------------------------------------------------
# the fixture in a K3 release's layouts
# ------------------------------------------------------------------------------------------------
# Each variant: (text_config changes, keep the indexer tensors, A_log stored [h] rather than padded)
VARIANTS = {
    # K3: index_* keys in the config, no indexer tensors; A_log as the official module holds it
    "k3": ({}, False, True),
    # the same with A_log zero-padded to 128, as the release stores it
    "k3-padded-A_log": ({}, False, False),
    # keys the config leaves out take the official defaults (rms_norm_eps 1e-6, SwiGLU, no latent norm)
    "defaults": ({"rms_norm_eps": None, "hidden_act": None, "activation_situ_beta": None,
                  "activation_situ_linear_beta": None, "latent_moe_use_norm": None}, False, True),
    # SiTU with beta absent (-> 1) and no squashing of the up input (linear beta absent)
    "situ-defaults": ({"activation_situ_beta": None, "activation_situ_linear_beta": None}, False, True),
    # a lone routed expert keeps its router score (no renormalization to 1)
    "top1": ({"num_experts_per_token": 1}, False, True),
    # q_a / kv_a_layernorm keep eps 1e-6 whatever rms_norm_eps says (large here, so it shows)
    "large-eps": ({"rms_norm_eps": 0.5}, False, True),
}


def _write_variant(out: Path, changes: dict, keep_indexer: bool, a_log_heads: bool) -> Path:
    out.mkdir(parents=True)
    config = json.loads((FIXTURE / "config.json").read_text())
    text = config["text_config"]
    for k, v in changes.items():
        if v is None:
            text.pop(k, None)
        else:
            text[k] = v
    h = text["linear_attn_config"]["num_heads"]
    latent_norm = bool(text.get("latent_moe_use_norm", False))
    tensors = {}
    for n, t in load_file(FIXTURE / "model.safetensors").items():
        if (".self_attn.indexer." in n and not keep_indexer) or (n.endswith("routed_expert_norm.weight")
                                                                 and not latent_norm):
            continue
        tensors[n] = t[:h].clone() if n.endswith("A_log") and a_log_heads else t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(FIXTURE / f, out / f)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3-official")
    made = {name: _write_variant(root / name, *v) for name, v in VARIANTS.items()}
    made["k3.1"] = _write_variant(root / "k3.1", {}, True, False)  # the fixture as it is: DSA indexer tensors
    return made


def _official_model(official, ckpt: Path):
    """The official KimiLinearForCausalLM (the K3 text model) holding exactly the checkpoint's text weights."""
    conf, modeling = official
    config = conf.KimiK3Config(**json.loads((ckpt / "config.json").read_text()))
    text = config.text_config
    text._attn_implementation = "eager"
    model = modeling.KimiLinearForCausalLM(text).eval()
    state = {n[len(PREFIX):]: t.float() for n, t in load_file(ckpt / "model.safetensors").items()
             if n.startswith(PREFIX) and ".self_attn.indexer." not in n}
    h = text.linear_attn_config["num_heads"]
    state = {n: t[:h] if n.endswith("A_log") else t for n, t in state.items()}  # the module holds [h]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def _ours(ckpt: Path, ids: torch.Tensor, **kw) -> tuple[list[fw.State], torch.Tensor]:
    """Our per-layer states and logits, through the validator's loader (which reads the spec the
    checkpoint's tensors decide)."""
    states = []
    with SourceLoader(ckpt) as ld:
        cfg = ld.cfg
        gw, _ = ld.globals(EMBED_NAMES)
        st = fw.embed(gw, ids)
        for i in range(cfg.num_hidden_layers):
            w, _ = ld.layer(i, lazy_experts=False)
            st = fw.layer_forward(cfg, i, w, st, **kw)
            states.append(st)
        hw, _ = ld.globals(HEAD_NAMES)
        return states, fw.head(cfg, hw, st)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / b.abs().max().item()


def _ids(T: int, B: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 1024, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------
# the comparisons
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_blocks_and_logits_match_the_official_code(official, checkpoints, variant):
    """Each attention and MLP block on the official block's own input, the router, every layer's
    output (running state and closed residual blocks) and the logits, at T = 40 > index_topk = 8."""
    ckpt = checkpoints[variant]
    model = _official_model(official, ckpt)
    spec = load_model_spec(ckpt)
    cfg = spec.text
    assert not cfg.has_indexer and cfg.index_topk == 8  # index_* keys without indexer tensors: dense MLA
    ids = _ids(40)
    seen: dict[tuple[int, str], tuple] = {}

    def record(i, part):
        def hook(module, args, kwargs, out):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            seen[(i, part)] = (x.detach(), out)
        return hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.self_attn.register_forward_hook(record(i, "attn"), with_kwargs=True))
        mlp = getattr(layer, "block_sparse_moe", None) or layer.mlp
        handles.append(mlp.register_forward_hook(record(i, "mlp"), with_kwargs=True))
        handles.append(layer.register_forward_hook(record(i, "layer"), with_kwargs=True))
    with torch.no_grad():
        ref_logits = model(input_ids=ids).logits
        for h in handles:
            h.remove()
        states, logits = _ours(ckpt, ids, kda_impl="recurrent")
        errors = {}
        with SourceLoader(ckpt) as ld:
            for i in range(cfg.num_hidden_layers):
                w, _ = ld.layer(i, lazy_experts=False)
                x, out = seen[(i, "attn")]
                kda = cfg.is_kda(i) and not cfg.is_full_attn(i)
                ours = fw.kda_attention(cfg, w, x, kda_impl="recurrent") if kda else fw.mla_attention(cfg, w, x)
                errors[i, "KDA" if kda else "MLA"] = _rel(ours, out)
                x, out = seen[(i, "mlp")]
                if cfg.is_dense(i):
                    errors[i, "dense MLP"] = _rel(fw.dense_mlp(cfg, w, x, "mlp."), out)
                else:
                    errors[i, "MoE"] = _rel(fw.moe(cfg, w, x), out)
                    gate = model.model.layers[i].block_sparse_moe.gate
                    ref_idx, ref_wts = gate(x)
                    idx, wts = fw.route(cfg, w["block_sparse_moe.gate.weight"],
                                        w["block_sparse_moe.gate.e_score_correction_bias"], x.reshape(-1, x.shape[-1]))
                    ref_order, order = ref_idx.sort(-1), idx.sort(-1)
                    assert torch.equal(ref_order.values, order.values), i
                    errors[i, "router"] = _rel(wts.gather(-1, order.indices), ref_wts.gather(-1, ref_order.indices))
                    if cfg.num_experts_per_token == 1:  # a lone expert's weight is its score, not 1
                        assert ref_wts.max() < 0.99 and torch.equal(wts, ref_wts), i
                ref_x, ref_blocks = seen[(i, "layer")][1]
                st = states[i]
                errors[i, "layer"] = _rel(st.x, ref_x)
                B, T, H = st.x.shape
                assert ref_blocks.shape[1] == len(st.blocks)
                for j, blk in enumerate(st.blocks):
                    errors[i, f"block {j}"] = _rel(blk, ref_blocks[:, j].view(B, T, H))
    errors["logits"] = _rel(logits, ref_logits)
    with torch.no_grad():
        errors["logits, chunked KDA"] = _rel(_ours(ckpt, ids)[1], ref_logits)  # the validator's default path
    bad = {k: f"{v:.2e}" for k, v in errors.items() if not v < TOL}
    assert not bad, bad
    assert (logits.argmax(-1) == ref_logits.argmax(-1)).all()


# what each rule replaced: (variant, our config changed back to the old reading)
OLD_READINGS = [
    ("large-eps", {"mla_kv_norm_eps": 0.5}),  # q_a / kv_a_layernorm on rms_norm_eps (at 1e-5 it would not show)
    ("defaults", {"hidden_act": "situ", "situ_beta": 4.0, "situ_linear_beta": 25.0}),  # absent: SiTU 4 / 25
    ("defaults", {"rms_norm_eps": 1e-5}),  # absent rms_norm_eps: 1e-5
    ("situ-defaults", {"situ_beta": 4.0}),
    ("situ-defaults", {"situ_linear_beta": 25.0}),
]


@pytest.mark.parametrize("variant,old", OLD_READINGS, ids=[f"{v}:{','.join(o)}" for v, o in OLD_READINGS])
def test_the_old_readings_miss_the_official_logits(official, checkpoints, variant, old):
    """The rules matter on this model: the readings they replaced move the logits far outside TOL."""
    import dataclasses

    ckpt = checkpoints[variant]
    ids = _ids(40, B=1)
    with torch.no_grad():
        ref = _official_model(official, ckpt)(input_ids=ids).logits
        with SourceLoader(ckpt) as ld:
            cfg = dataclasses.replace(ld.cfg, **old)
            st = fw.embed(ld.globals(EMBED_NAMES)[0], ids)
            for i in range(cfg.num_hidden_layers):
                st = fw.layer_forward(cfg, i, ld.layer(i)[0], st)
            out = fw.head(cfg, ld.globals(HEAD_NAMES)[0], st)
    assert _rel(out, ref) > 20 * TOL  # measured 6.7e-4 (linear beta 25) to 0.24


def test_k31_with_indexer_tensors_keeps_dsa(official, checkpoints):
    """The fixture as it is (K3.1: indexer tensors present) runs DSA: up to index_topk tokens every key
    is selected and the logits are the official dense model's; past it they are not."""
    ckpt = checkpoints["k3.1"]
    assert load_model_spec(ckpt).text.has_indexer
    model = _official_model(official, ckpt)
    with torch.no_grad():
        short = _ids(8)
        _, ours = _ours(ckpt, short)
        assert _rel(ours, model(input_ids=short).logits) < TOL
        long = _ids(40)
        _, ours = _ours(ckpt, long)
        assert _rel(ours, model(input_ids=long).logits) > 100 * TOL


# ------------------------------------------------------------------------------------------------
# the spec's reading of a checkpoint (no official code needed)
# ------------------------------------------------------------------------------------------------
def test_indexer_presence_comes_from_the_tensors(checkpoints):
    fixture_cfg = json.loads((FIXTURE / "config.json").read_text())
    from_config = spec_from_config(fixture_cfg)
    assert from_config.text.has_indexer  # no tensors known: the config's complete index_* keys decide
    names = set(from_config.expected_tensors(with_vision=False))
    indexer = {n for n in names if ".self_attn.indexer." in n}
    assert indexer
    k3 = from_config.for_tensors(names - indexer, "ckpt")
    assert not k3.text.has_indexer and not any(".indexer." in n for n in k3.expected_tensors())
    assert from_config.for_tensors(names, "ckpt").text.has_indexer
    # a loader's spec: the local checkpoint's tensors decide
    assert not load_model_spec(checkpoints["k3"]).text.has_indexer
    assert load_model_spec(checkpoints["k3.1"]).text.has_indexer
    # indexer tensors the config cannot run: one line naming what is missing
    del fixture_cfg["text_config"]["index_topk"]
    no_topk = spec_from_config(fixture_cfg)
    assert not no_topk.text.has_indexer
    with pytest.raises(KimiQuantError, match=r"^ckpt: tensor 'language_model\.model\.layers\.3\.self_attn\.indexer\."
                                             r"k_norm\.bias' belongs to a DSA indexer, but config\.json has no "
                                             r"index_topk to run it with$"):
        no_topk.for_tensors(names, "ckpt")


def test_check_inventory_takes_either_layout(checkpoints):
    """check_inventory decides the indexer from what it is given, and takes A_log as [h] or padded."""
    spec = spec_from_config(json.loads((FIXTURE / "config.json").read_text()))
    for variant in ("k3", "k3-padded-A_log", "k3.1"):
        found = {n: (tuple(t.shape), "F32" if t.dtype == torch.float32 else "BF16")
                 for n, t in load_file(checkpoints[variant] / "model.safetensors").items()}
        spec.check_inventory(found, variant)
    a_log = "language_model.model.layers.0.self_attn.A_log"
    found[a_log] = ((5,), "F32")
    with pytest.raises(KimiQuantError, match=r"A_log' has shape \[5\] but config.json implies \[128\]"):
        spec.check_inventory(found, "bad")
    found = {n: v for n, v in found.items() if "layers.3.self_attn.indexer.wk" not in n}
    found[a_log] = ((128,), "F32")
    with pytest.raises(KimiQuantError, match=r"layers\.3\.self_attn\.indexer\.wk\.weight' is missing"):
        spec.check_inventory(found, "partial indexer")


def test_a_log_padding_must_be_zeros(checkpoints, tmp_path):
    """A non-zero value past the first h of a padded A_log is refused, in one line, when read."""
    ckpt = _write_variant(tmp_path / "bad", {}, False, False)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["language_model.model.layers.1.self_attn.A_log"][100] = 0.5
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BadCheckpoint, match=r"^tensor 'model\.layers\.1\.self_attn\.A_log' \[128\] has non-zero "
                                            r"values past the first 4 \(largest 0\.5\)"):
        _ours(ckpt, _ids(5))
    head = torch.tensor([0.1, 0.2, 0.3, 0.4])
    assert torch.equal(fw.kda_head_A_log(head, 4, "x"), head)
    assert torch.equal(fw.kda_head_A_log(head.view(1, 1, 4, 1), 4, "x"), head)  # FLA's layout (Kimi Linear)
    with pytest.raises(BadCheckpoint, match="only 3 values"):
        fw.kda_head_A_log(head[:3], 4, "x")


def test_absent_keys_take_the_official_defaults(official_config):
    """A config that leaves the optional keys out reads as the official KimiLinearConfig reads it."""
    conf = official_config
    fixture_text = json.loads((FIXTURE / "config.json").read_text())["text_config"]
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts",
                "num_experts_per_token", "moe_intermediate_size")
    minimal = {k: fixture_text[k] for k in required}
    ref = conf.KimiLinearConfig(**minimal)
    ours = spec_from_config({**minimal, "model_type": "kimi_linear"}).text
    beta = ref.activation_situ_beta or 1.0  # as the official SiTU reads it
    lac = ref.linear_attn_config or {}
    pairs = {
        "rms_norm_eps": (ours.rms_norm_eps, ref.rms_norm_eps),
        "hidden_act": (ours.hidden_act, ref.hidden_act),
        "activation_situ_beta": (ours.situ_beta, beta),
        "activation_situ_linear_beta": (ours.situ_linear_beta, ref.activation_situ_linear_beta),
        "latent_moe_use_norm": (ours.latent_moe_use_norm, ref.latent_moe_use_norm),
        "moe_renormalize": (ours.moe_renormalize, ref.moe_renormalize),
        "routed_scaling_factor": (ours.routed_scaling_factor, ref.routed_scaling_factor),
        "num_shared_experts": (ours.num_shared_experts, ref.num_shared_experts),
        "first_k_dense_replace": (ours.first_k_dense_replace, ref.first_k_dense_replace),
        "num_expert_group": (ours.num_expert_group, ref.num_expert_group),
        "topk_group": (ours.topk_group, ref.topk_group),
        "topk_method": (ours.topk_method, ref.topk_method),
        "moe_router_activation_func": (ours.router_scoring, ref.moe_router_activation_func),
        "mla_use_output_gate": (ours.mla_use_output_gate, ref.mla_use_output_gate),
        "q_lora_rank": (ours.q_lora_rank, ref.q_lora_rank),
        "attn_res_block_size": (ours.attn_res_block_size, ref.attn_res_block_size),
        "routed_expert_hidden_size": (ours.routed_expert_hidden_size, ref.routed_expert_hidden_size),
        "use_full_rank_gate": (ours.use_full_rank_gate, lac.get("use_full_rank_gate", False)),
        "gate_lower_bound": (ours.gate_lower_bound, lac.get("gate_lower_bound")),
    }
    differ = {k: v for k, v in pairs.items() if v[0] != v[1]}
    assert not differ, differ
    # the official MLA latent norms are KimiRMSNorm(dim) with its default eps, whatever rms_norm_eps is
    assert ours.mla_kv_norm_eps == 1e-6


def test_the_official_code_unpacks_safely(tmp_path):
    """The pinned wheel's kimi_k3 .py files only; an unsafe member among them is refused."""
    root = consumer_sources.cache_dir()
    try:
        src = consumer_sources.kimi_k3_official_source()
    except consumer_sources.Unavailable as e:
        pytest.skip(str(e))
    assert src.is_relative_to(root)
    assert {"configuration_kimi_k3.py", "modeling_kimi_linear.py", "modeling_kimi_k3.py"} <= \
        {p.name for p in src.iterdir()}
    unpacked = src.parents[2]
    assert {p.suffix for p in unpacked.rglob("*") if p.is_file() and p.name != ".kimi-quant-unpacked"} == {".py"}
    evil = tmp_path / "evil.whl"
    with zipfile.ZipFile(evil, "w") as z:
        z.writestr("llmcompressor/modeling/kimi_k3/../../../../escape.py", "x = 1\n")
    extract = consumer_sources.unzip_py(consumer_sources.KIMI_K3_OFFICIAL, "llmcompressor/modeling/kimi_k3")
    with pytest.raises(consumer_sources.Unavailable, match="unsafe member"):
        extract(evil, tmp_path / "out")
    assert not (tmp_path / "escape.py").exists()
