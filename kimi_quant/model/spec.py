"""Kimi K3 / K3.1 family: read config.json, name every tensor, give each a role.

The role of a tensor (routed-expert gate, attention projection, norm, ...) is decided here, from
the model's structure, and nowhere else: the recipe maps roles to schemes and the layout step
uses ``TensorRole.matmul`` (gate / up / down) for ``scale_bias`` without ever looking at names.
Kimi experts are named ``w1`` (gate), ``w3`` (up) and ``w2`` (down), which name-substring
heuristics get wrong.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import KimiQuantError
from ..output_files import INDEX as OUTPUT_INDEX
from ..source.base import SINGLE_FILE, WEIGHT_INDEX
from ..source.local import LocalSource
from ..untrusted import parse_json
from .config import SUPPORTED_FAMILIES, TextConfig

@dataclass(frozen=True)
class TensorRole:
    """What a tensor is in the model, independent of how it is named."""

    role: str  # e.g. "routed_expert.down", "kda.qkv_proj", "norm"
    layer: int | None = None
    expert: int | None = None
    matmul: str | None = None  # "gate" | "up" | "down" for MLP-style linears (decides scale_bias)
    linear: bool = False  # a Linear weight [out, in]: may be quantized
    fuse_group: str | None = None  # tensors the loader fuses (or groups): they must share one scheme


# Roles by name, relative to the text model prefix. Order matters: the first match wins.
# Each entry: (regex, role, matmul, linear, fuse-group template). Groups: {L} = layer.
_LAYER = r"model\.layers\.(?P<layer>\d+)\."
_ROLE_TABLE: list[tuple[str, str, str | None, bool, str | None]] = [
    (_LAYER + r"block_sparse_moe\.experts\.(?P<expert>\d+)\.w1\.weight", "routed_expert.gate", "gate", True, "L{L}.experts"),
    (_LAYER + r"block_sparse_moe\.experts\.(?P<expert>\d+)\.w3\.weight", "routed_expert.up", "up", True, "L{L}.experts"),
    (_LAYER + r"block_sparse_moe\.experts\.(?P<expert>\d+)\.w2\.weight", "routed_expert.down", "down", True, "L{L}.experts"),
    (_LAYER + r"block_sparse_moe\.shared_experts\.gate_proj\.weight", "shared_expert.gate", "gate", True, "L{L}.shared_experts.gate_up"),
    (_LAYER + r"block_sparse_moe\.shared_experts\.up_proj\.weight", "shared_expert.up", "up", True, "L{L}.shared_experts.gate_up"),
    (_LAYER + r"block_sparse_moe\.shared_experts\.down_proj\.weight", "shared_expert.down", "down", True, None),
    (_LAYER + r"block_sparse_moe\.routed_expert_down_proj\.weight", "latent_moe.down_proj", None, True, None),
    (_LAYER + r"block_sparse_moe\.routed_expert_up_proj\.weight", "latent_moe.up_proj", None, True, None),
    (_LAYER + r"block_sparse_moe\.routed_expert_norm\.weight", "norm", None, False, None),
    (_LAYER + r"block_sparse_moe\.gate\.weight", "router.gate", None, True, None),
    (_LAYER + r"block_sparse_moe\.gate\.e_score_correction_bias", "router.bias", None, False, None),
    (_LAYER + r"mlp\.gate_proj\.weight", "dense_mlp.gate", "gate", True, "L{L}.mlp.gate_up"),
    (_LAYER + r"mlp\.up_proj\.weight", "dense_mlp.up", "up", True, "L{L}.mlp.gate_up"),
    (_LAYER + r"mlp\.down_proj\.weight", "dense_mlp.down", "down", True, None),
    (_LAYER + r"self_attn\.indexer\.(wq_b|wk|weights_proj)\.weight", "dsa.indexer_proj", None, True, None),
    (_LAYER + r"self_attn\.indexer\..*", "dsa.indexer_norm", None, False, None),
    # KDA input projections: the serving stacks fuse them into one Linear whose scheme is looked up
    # from its parts (SGLang: fused_qkvg_proj = q,k,v,g; vLLM K3: in_proj_qkvgfab = q,k,v,g,f_a,b), so
    # all six share one fuse group; f_b_proj (input = head_dim) stays its own Linear everywhere.
    (_LAYER + r"self_attn\.[qkv]_proj\.weight", "kda.qkv_proj", None, True, "L{L}.kda_in_proj"),
    (_LAYER + r"self_attn\.[qkv]_conv1d\.weight", "kda.conv1d", None, False, None),
    (_LAYER + r"self_attn\.(f_a_proj|b_proj)\.weight", "kda.fa_b_proj", None, True, "L{L}.kda_in_proj"),
    (_LAYER + r"self_attn\.f_b_proj\.weight", "kda.f_b_proj", None, True, None),
    (_LAYER + r"self_attn\.(g_a_proj|g_b_proj)\.weight", "kda.gate_proj", None, True, None),  # low-rank output gate
    (_LAYER + r"self_attn\.(A_log|dt_bias)", "kda.param", None, False, None),
    (_LAYER + r"self_attn\.q_a_proj\.weight", "mla.q_a_proj", None, True, "L{L}.qkv_a"),
    (_LAYER + r"self_attn\.kv_a_proj_with_mqa\.weight", "mla.kv_a_proj", None, True, "L{L}.qkv_a"),
    (_LAYER + r"self_attn\.q_b_proj\.weight", "mla.q_b_proj", None, True, None),
    (_LAYER + r"self_attn\.kv_b_proj\.weight", "mla.kv_b_proj", None, True, None),
    (_LAYER + r"self_attn\.g_proj\.weight", "attn.g_proj", None, True, None),  # KDA layers: kda.g_proj (see role())
    (_LAYER + r"self_attn\.o_proj\.weight", "attn.o_proj", None, True, None),
    (_LAYER + r".*(norm|layernorm)\.(weight|bias)", "norm", None, False, None),
    (_LAYER + r"(self_attention|mlp)_res_proj\.weight", "attn_res.proj", None, False, None),
    (r"model\.output_attn_res_proj\.weight", "attn_res.proj", None, False, None),
    (r"model\.(norm|output_attn_res_norm)\.weight", "norm", None, False, None),
    (r"model\.embed_tokens\.weight", "embedding", None, False, None),
    (r"lm_head\.weight", "lm_head", None, True, None),
]
_COMPILED = [(re.compile(p), role, mm, lin, fg) for p, role, mm, lin, fg in _ROLE_TABLE]
#: every role ``ModelSpec.role`` can return (what recipe role keys may name)
KNOWN_ROLES: tuple[str, ...] = tuple(sorted({r for _, r, *_ in _ROLE_TABLE} | {"mla.q_proj", "kda.g_proj", "vision", "other"}))
_VISION = re.compile(r"(vision_tower|mm_projector|multi_modal_projector)\.")


@dataclass(frozen=True)
class ModelSpec:
    """A recognised K3-family model: its text config and how its tensors are named."""

    family: str  # "kimi_k3" | "kimi_linear"
    text: TextConfig | None  # None for a generic (non-K3) model converted with a user recipe
    prefix: str  # prefix of text-model tensors: "language_model." for kimi_k3, "" for kimi_linear
    config: dict[str, Any] = field(compare=False, repr=False, default_factory=dict)

    def role(self, name: str) -> TensorRole:
        """The role of tensor ``name``; unknown names get role "other" (FLOAT unless a recipe says otherwise)."""
        if self.family == "generic":
            return TensorRole("other")
        if _VISION.match(name):
            return TensorRole("vision")
        rel = name[len(self.prefix):] if self.prefix and name.startswith(self.prefix) else name
        for rx, role, matmul, linear, fuse in _COMPILED:
            m = rx.fullmatch(rel)
            if m:
                gd = m.groupdict()
                layer = int(gd["layer"]) if gd.get("layer") is not None else None
                expert = int(gd["expert"]) if gd.get("expert") is not None else None
                if role == "kda.qkv_proj" and self.text is not None and not self._is_kda_layer(layer):
                    role, fuse = "mla.q_proj", None  # Kimi Linear's MLA without a query latent (q_lora_rank null)
                if role == "attn.g_proj" and self.text is not None and self._is_kda_layer(layer):
                    # a KDA layer's full-rank output gate is fused with q/k/v by the serving stacks;
                    # an MLA layer's output gate is a Linear of its own
                    role, fuse = "kda.g_proj", "L{L}.kda_in_proj"
                return TensorRole(role, layer, expert, matmul, linear,
                                  fuse.format(L=layer) if fuse else None)
        return TensorRole("other")

    def _is_kda_layer(self, layer: int | None) -> bool:
        return layer is not None and self.text.is_kda(layer) and not self.text.is_full_attn(layer)

    def for_tensors(self, names: Iterable[str], where: str) -> "ModelSpec":
        """This spec with what the checkpoint's tensor ``names`` decide (whether the MLA layers have a
        DSA indexer); every loader of a real checkpoint goes through this."""
        if self.text is None:
            return self
        return dataclasses.replace(self, text=self.text.with_indexer_from(names, self.prefix, where))

    def check_inventory(self, found: dict[str, tuple[tuple[int, ...], str]], where: str) -> None:
        """The checkpoint's tensors (name -> (shape, dtype)) are the ones config.json describes: each
        missing, extra, wrongly shaped or non-float tensor is refused in one line (a checkpoint that does
        not match its config would convert into an output that looks complete and does not load).
        Vision-tower tensors are not modelled here and pass; a generic model (user recipe) is not checked."""
        if self.text is None:
            return
        spec = self if self.text.dsa_indexer is not None else self.for_tensors(found, where)
        t = spec.text
        moe_layers = max(0, t.num_hidden_layers - t.first_k_dense_replace)
        at_least = moe_layers * 3 * t.num_experts + t.num_hidden_layers * 8
        if at_least > 2 * len(found) + 1000:  # before enumerating what could be billions of names
            raise KimiQuantError(f"{where}: config.json describes at least {at_least} tensors (num_hidden_layers "
                                 f"{t.num_hidden_layers}, num_experts {t.num_experts}) but the checkpoint holds "
                                 f"{len(found)}: not this checkpoint's config")
        expected = spec.expected_tensors(with_vision=False)
        text = {n: v for n, v in found.items() if not _VISION.match(n)}
        missing = sorted(set(expected) - set(text))
        extra = sorted(set(text) - set(expected))
        more = lambda xs: f" (and {len(xs) - 1} more)" if len(xs) > 1 else ""  # noqa: E731
        if missing:
            raise KimiQuantError(f"{where}: tensor {missing[0]!r}{more(missing)} is missing: config.json's model has it")
        if extra:
            raise KimiQuantError(f"{where}: tensor {extra[0]!r}{more(extra)} is not part of the model config.json "
                                 "describes (wrong config, or a stray tensor)")
        for name, (shape, dtype) in sorted(text.items()):
            want = expected[name][0]
            # A_log: the K3 release pads it to 128 heads, the official module holds [h]: either will do
            # (the forward refuses a padding that is not zeros when it reads the values)
            if tuple(shape) != want and not (name.endswith(".self_attn.A_log") and spec.family == "kimi_k3"
                                             and tuple(shape) == (t.kda_num_heads,)):
                raise KimiQuantError(f"{where}: tensor {name!r} has shape {list(shape)} but config.json implies "
                                     f"{list(want)}")
            if dtype not in ("BF16", "F16", "F32"):
                raise KimiQuantError(f"{where}: tensor {name!r} is {dtype}; a BF16 checkpoint holds float tensors "
                                     f"(config.json's model has {expected[name][1]} here)")

    def expected_tensors(self, with_vision: bool = True) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every tensor a checkpoint of this config holds: name -> (shape, safetensors dtype). A K3
        checkpoint may also store ``A_log`` as [h] (the official module's shape); see check_inventory."""
        return expected_tensors(self.text, self.prefix, with_vision=with_vision and self.family == "kimi_k3",
                                family=self.family)


def expected_tensors(t: TextConfig, prefix: str = "language_model.", with_vision: bool = True,
                     family: str = "kimi_k3") -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and dtypes of a checkpoint of config ``t``. Kimi Linear (``family="kimi_linear"``)
    stores ``A_log`` as [1, 1, h, 1] (FLA's layout); the K3 release pads it to a multiple of 128 heads
    with zeros (the shape given here; [h] is accepted too)."""
    H, V = t.hidden_size, t.vocab_size
    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def add(name: str, shape: tuple[int, ...], dtype: str = "BF16") -> None:
        out[prefix + name] = (tuple(int(s) for s in shape), dtype)

    add("model.embed_tokens.weight", (V, H))
    for i in range(t.num_hidden_layers):
        L = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            add(L + n + ".weight", (H,))
        if t.attn_res_block_size:
            add(L + "self_attention_res_norm.weight", (H,))
            add(L + "mlp_res_norm.weight", (H,))
            add(L + "self_attention_res_proj.weight", (1, H))
            add(L + "mlp_res_proj.weight", (1, H))
        if t.is_kda(i):
            h, d, K = t.kda_num_heads, t.kda_head_dim, t.short_conv_kernel_size
            P = h * d
            for x in "qkv":
                add(L + f"self_attn.{x}_proj.weight", (P, H))
            for x in "qkv":
                add(L + f"self_attn.{x}_conv1d.weight", (P, 1, K), "F32")
            add(L + "self_attn.f_a_proj.weight", (d, H))
            add(L + "self_attn.f_b_proj.weight", (P, d))
            add(L + "self_attn.A_log", (1, 1, h, 1) if family == "kimi_linear" else (-(-h // 128) * 128,), "F32")
            add(L + "self_attn.dt_bias", (P,), "F32")
            add(L + "self_attn.b_proj.weight", (h, H))
            if t.use_full_rank_gate:
                add(L + "self_attn.g_proj.weight", (P, H))
            else:
                add(L + "self_attn.g_a_proj.weight", (d, H))
                add(L + "self_attn.g_b_proj.weight", (P, d))
            add(L + "self_attn.o_norm.weight", (d,), "F32")
            add(L + "self_attn.o_proj.weight", (H, P))
        else:
            nh, dn, dr, dv = t.num_attention_heads, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim
            ql, kl = t.q_lora_rank, t.kv_lora_rank
            if ql is None:
                add(L + "self_attn.q_proj.weight", (nh * (dn + dr), H))
            else:
                add(L + "self_attn.q_a_proj.weight", (ql, H))
                add(L + "self_attn.q_a_layernorm.weight", (ql,))
                add(L + "self_attn.q_b_proj.weight", (nh * (dn + dr), ql))
            add(L + "self_attn.kv_a_proj_with_mqa.weight", (kl + dr, H))
            add(L + "self_attn.kv_a_layernorm.weight", (kl,))
            add(L + "self_attn.kv_b_proj.weight", (nh * (dn + dv), kl))
            if t.mla_use_output_gate:
                add(L + "self_attn.g_proj.weight", (nh * dv, H))
            add(L + "self_attn.o_proj.weight", (H, nh * dv))
            if t.has_indexer:
                ih, idd = int(t.index_n_heads), int(t.index_head_dim)
                add(L + "self_attn.indexer.wq_b.weight", (ih * idd, ql))
                add(L + "self_attn.indexer.wk.weight", (idd, H))
                add(L + "self_attn.indexer.k_norm.weight", (idd,))
                add(L + "self_attn.indexer.k_norm.bias", (idd,))
                add(L + "self_attn.indexer.weights_proj.weight", (ih, H))
        if t.is_dense(i):
            D = t.intermediate_size
            add(L + "mlp.gate_proj.weight", (D, H))
            add(L + "mlp.up_proj.weight", (D, H))
            add(L + "mlp.down_proj.weight", (H, D))
        else:
            E, I, R, S = t.num_experts, t.moe_intermediate_size, t.latent_size, t.num_shared_experts
            M = L + "block_sparse_moe."
            add(M + "gate.weight", (E, H))
            add(M + "gate.e_score_correction_bias", (E,), "F32")
            if t.routed_expert_hidden_size:
                add(M + "routed_expert_down_proj.weight", (R, H))
                if t.latent_moe_use_norm:
                    add(M + "routed_expert_norm.weight", (R,))
                add(M + "routed_expert_up_proj.weight", (H, R))
            for e in range(E):
                add(M + f"experts.{e}.w1.weight", (I, R))
                add(M + f"experts.{e}.w3.weight", (I, R))
                add(M + f"experts.{e}.w2.weight", (R, I))
            if S:
                add(M + "shared_experts.gate_proj.weight", (I * S, H))
                add(M + "shared_experts.up_proj.weight", (I * S, H))
                add(M + "shared_experts.down_proj.weight", (H, I * S))
    add("model.norm.weight", (H,))
    if t.attn_res_block_size:
        add("model.output_attn_res_norm.weight", (H,))
        add("model.output_attn_res_proj.weight", (1, H))
    add("lm_head.weight", (V, H))
    if with_vision:
        # A few vision tensors so that "never quantized" is exercised; the real tower is larger.
        out["vision_tower.patch_embed.proj.weight"] = ((H, 3 * 14 * 14), "BF16")
        out["vision_tower.blocks.0.attn.qkv.weight"] = ((3 * H, H), "BF16")
        out["vision_tower.blocks.0.norm1.weight"] = ((H,), "BF16")
        out["mm_projector.proj.0.weight"] = ((H, H), "BF16")
    return out


def spec_from_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Recognise the K3 family from a parsed config.json, or refuse naming what is supported."""
    if not isinstance(config, dict):
        raise KimiQuantError(f"{source}: expected a JSON object, got a {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type == "kimi_k3":
        if not isinstance(config.get("text_config"), dict):
            raise KimiQuantError(f"{source}: model_type 'kimi_k3' needs a 'text_config' object, "
                                 f"got {config.get('text_config')!r}")
        return ModelSpec("kimi_k3", TextConfig.from_dict(config["text_config"]), "language_model.", config)
    if model_type == "kimi_linear":
        return ModelSpec("kimi_linear", TextConfig.from_dict(config), "", config)
    raise KimiQuantError(
        f"{source}: model_type {model_type!r} is not a supported family; supported: "
        f"{'; '.join(SUPPORTED_FAMILIES)} (or pass --recipe to convert another model)")


def load_model_spec(source_dir: str | Path) -> ModelSpec:
    """The spec of a local checkpoint: its config.json, and what its tensor names decide (when it has
    safetensors weights; a directory with config.json only gets the config's reading)."""
    path = Path(source_dir) / "config.json"
    try:
        config = parse_json(path.read_bytes(), str(path))
    except FileNotFoundError:
        raise KimiQuantError(f"{path}: not found (a source needs config.json)") from None
    spec = spec_from_config(config, str(path))
    names = _local_tensor_names(Path(source_dir)) if spec.text is not None else None
    return spec if names is None else spec.for_tensors(names, str(source_dir))




def _local_tensor_names(root: Path) -> list[str] | None:
    """The tensor names of the checkpoint in ``root``: a source's index or single file, else an ascendV1
    output's index; None when there is none (or the output's index is unreadable: its loader says so)."""
    if (root / WEIGHT_INDEX).is_file() or (root / SINGLE_FILE).is_file():
        return list(LocalSource(root).weight_map())
    if (root / OUTPUT_INDEX).is_file():
        index = LocalSource(root).read_json(OUTPUT_INDEX)
        wm = index.get("weight_map") if isinstance(index, dict) else None
        return [str(n) for n in wm] if isinstance(wm, dict) else None
    return None


def load_model_spec_from_source(source, recipe_given: bool = False) -> ModelSpec:
    """The spec of a Source's config.json; with a user recipe, an unknown family is converted generically."""
    config = source.read_json("config.json")
    if not isinstance(config, dict):  # before config.get below
        raise KimiQuantError(f"{source.id}/config.json: expected a JSON object, got a {type(config).__name__}")
    try:
        spec = spec_from_config(config, f"{source.id}/config.json")
    except KimiQuantError:
        if not recipe_given or config.get("model_type") in ("kimi_k3", "kimi_linear"):
            raise
        return ModelSpec("generic", None, "", config)
    return spec.for_tensors(source.weight_map(), source.id)
