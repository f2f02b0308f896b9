"""A Kimi K3-family config.json read into ``TextConfig``: every dimension the roles, the plan and the
forward need, bounded and checked (a hostile config gets one line, not a huge allocation), with the
official model code's defaults for absent keys."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import KimiQuantError

#: a tensor of a DSA indexer (relative to the text prefix): its presence decides whether MLA runs one
INDEXER_TENSOR = re.compile(r"model\.layers\.(?P<layer>\d+)\.self_attn\.indexer\.")

SUPPORTED_FAMILIES = ("kimi_k3 (Kimi K3 / K3.1, with or without the DSA indexer)",
                      "kimi_linear (Kimi Linear 48B-A3B layout: low-rank KDA output gate, softplus decay, MLA without q_lora)")


def _first(d: dict[str, Any], *keys: str, default: Any) -> Any:
    """The value of the first of ``keys`` present (and not null) in ``d``: configs of the family spell
    some settings two ways (Kimi ``num_expert_group`` / DeepSeek ``n_group``)."""
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


# Bounds on config numbers: far above any real model, low enough that a hostile config.json cannot make
# planning enumerate billions of tensor names (K3.1 Pro: 93 layers, 896 experts, vocab 163840).
MAX_LAYERS = 4096
MAX_EXPERTS = 65536
MAX_VOCAB = 1 << 24
MAX_DIM = 1 << 20


class _Bad(ValueError):
    pass


def _count(d: dict, key: str, default, lo: int, hi: int) -> int | None:
    """``d[key]`` as a JSON integer in [lo, hi]; ``default`` when absent (or null, for an optional key).
    1e12, -1, "6" and true are refused by name: int() would take "6" and 6.0 and let -1 through."""
    v = d.get(key)
    if v is None:
        if key in _REQUIRED:
            raise _Bad(f"{key} is missing")
        return default
    if type(v) is not int:
        raise _Bad(f"{key} must be a whole number, got {v!r}"[:160])
    if not lo <= v <= hi:
        raise _Bad(f"{key} = {v} is out of range (expected {lo} to {hi})")
    return v


_REQUIRED = {"vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
             "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts",
             "num_experts_per_token", "moe_intermediate_size"}


def _layer_list(lac: dict, key: str, layers: int) -> tuple[int, ...]:
    v = lac.get(key, [])
    if not isinstance(v, list) or any(type(x) is not int or not 1 <= x <= layers for x in v):
        raise _Bad(f"linear_attn_config.{key} must list layer numbers 1..{layers}, got {str(v)[:80]}")
    return tuple(v)


@dataclass(frozen=True)
class TextConfig:
    """The text settings of a K3-family config, with the names config.json uses."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    q_lora_rank: int | None  # None: MLA queries come from one q_proj (Kimi Linear)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None
    first_k_dense_replace: int
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    kda_layers: tuple[int, ...]  # 1-based, as in config.json
    full_attn_layers: tuple[int, ...]  # 1-based
    attn_res_block_size: int | None
    # Defaults for absent keys are the official modeling code's (moonshotai's configuration_kimi_k3.py,
    # KimiLinearConfig): a config that leaves a key out means what the model it was trained with does.
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"  # "situ": SiTU MLPs (K3); "silu": SwiGLU
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    # Whether the MLA layers carry a DSA indexer is the checkpoint's to say (K3 configs may keep index_*
    # keys without indexer tensors; the official K3 code has no indexer): None until the tensor names are
    # known (:meth:`ModelSpec.for_tensors`), and meanwhile the config's index_* keys decide.
    dsa_indexer: bool | None = None
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True  # applied only when num_experts_per_token > 1 (as the official router)
    situ_beta: float = 1.0  # activation_situ_beta; null or absent: 1.0
    situ_linear_beta: float | None = None  # activation_situ_linear_beta; None: the up input is not squashed
    gate_lower_bound: float | None = -5.0  # None: softplus decay gate (Kimi Linear); else lb * sigmoid (K3)
    latent_moe_use_norm: bool = False  # False: no routed_expert_norm tensor, no norm on the latent output
    use_full_rank_gate: bool = True  # KDA output gate: g_proj [P,H], or low-rank g_a_proj [d,H] + g_b_proj [P,d]
    mla_use_output_gate: bool = True
    # eps of q_a_layernorm / kv_a_layernorm: the official modules build them without an eps argument, so
    # RMSNorm's default applies whatever rms_norm_eps says (K3 and Kimi Linear alike)
    mla_kv_norm_eps: float = 1e-6
    # router (DeepSeek-V3 "noaux_tc"): sigmoid scores, + e_score_correction_bias for the choice only,
    # experts in num_expert_group groups of which topk_group are kept (group score = sum of its top-2)
    num_expert_group: int = 1
    topk_group: int = 1
    router_scoring: str = "sigmoid"
    topk_method: str = "noaux_tc"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TextConfig":
        try:
            lac = d.get("linear_attn_config") or {}
            if not isinstance(lac, dict):
                raise _Bad(f"linear_attn_config must be an object, got {lac!r}"[:160])
            n = lambda key, default=None, lo=1, hi=MAX_DIM, where=d: _count(where, key, default, lo, hi)  # noqa: E731
            layers = n("num_hidden_layers", hi=MAX_LAYERS)
            t = cls(
                vocab_size=n("vocab_size", hi=MAX_VOCAB),
                hidden_size=n("hidden_size"),
                num_hidden_layers=layers,
                intermediate_size=n("intermediate_size"),
                num_attention_heads=n("num_attention_heads"),
                q_lora_rank=n("q_lora_rank", None),  # null: MLA without a query latent (Kimi Linear)
                kv_lora_rank=n("kv_lora_rank"),
                qk_nope_head_dim=n("qk_nope_head_dim"),
                qk_rope_head_dim=n("qk_rope_head_dim"),
                v_head_dim=n("v_head_dim"),
                num_experts=n("num_experts", lo=0, hi=MAX_EXPERTS),
                num_experts_per_token=n("num_experts_per_token", lo=0, hi=MAX_EXPERTS),
                num_shared_experts=n("num_shared_experts", 0, lo=0, hi=MAX_EXPERTS),
                moe_intermediate_size=n("moe_intermediate_size"),
                routed_expert_hidden_size=n("routed_expert_hidden_size", None),
                first_k_dense_replace=n("first_k_dense_replace", 0, lo=0, hi=MAX_LAYERS),
                kda_num_heads=n("num_heads", 0, lo=0, where=lac),
                kda_head_dim=n("head_dim", 0, lo=0, where=lac),
                short_conv_kernel_size=n("short_conv_kernel_size", 4, where=lac),
                kda_layers=_layer_list(lac, "kda_layers", layers),
                full_attn_layers=_layer_list(lac, "full_attn_layers", layers),
                attn_res_block_size=n("attn_res_block_size", None),
                rms_norm_eps=float(_first(d, "rms_norm_eps", default=1e-6)),
                hidden_act=str(_first(d, "hidden_act", default="silu")),
                index_n_heads=n("index_n_heads", None),
                index_head_dim=n("index_head_dim", None),
                index_topk=n("index_topk", None),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                moe_renormalize=bool(_first(d, "moe_renormalize", "norm_topk_prob", default=True)),
                # the official SiTU takes ``beta or 1.0``: 0 and null mean 1.0 there too
                situ_beta=float(d.get("activation_situ_beta") or 1.0),
                situ_linear_beta=None if d.get("activation_situ_linear_beta") is None
                else float(d["activation_situ_linear_beta"]),
                gate_lower_bound=None if lac.get("gate_lower_bound") is None else float(lac["gate_lower_bound"]),
                latent_moe_use_norm=bool(d.get("latent_moe_use_norm", False)),
                use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
                mla_use_output_gate=bool(d.get("mla_use_output_gate", False)),
                num_expert_group=int(_first(d, "num_expert_group", "n_group", default=1)),
                topk_group=int(_first(d, "topk_group", default=1)),
                router_scoring=str(_first(d, "moe_router_activation_func", "scoring_func", default="sigmoid")),
                topk_method=str(_first(d, "topk_method", default="noaux_tc")),
                raw=d,
            )
        except _Bad as e:
            raise KimiQuantError(f"config.json: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # AttributeError: a list where an object belongs
            raise KimiQuantError(f"config.json: K3-family text config is missing or has a bad field: {e}") from None
        if t.first_k_dense_replace < t.num_hidden_layers and not 1 <= t.num_experts_per_token <= t.num_experts:
            raise KimiQuantError(f"config.json: num_experts {t.num_experts} and num_experts_per_token "
                                 f"{t.num_experts_per_token}: MoE layers need 1 <= num_experts_per_token <= num_experts")
        if t.kda_layers and not (t.kda_num_heads and t.kda_head_dim):
            raise KimiQuantError("config.json: linear_attn_config lists kda_layers but no num_heads / head_dim")
        return t

    # -- layer structure ------------------------------------------------------------------
    def is_kda(self, layer: int) -> bool:
        return (layer + 1) in self.kda_layers

    def is_full_attn(self, layer: int) -> bool:
        return (layer + 1) in self.full_attn_layers or not self.kda_layers

    def is_dense(self, layer: int) -> bool:
        return layer < self.first_k_dense_replace

    @property
    def has_indexer(self) -> bool:
        """The MLA layers select keys with a DSA indexer: the checkpoint has its tensors (once known),
        else the config declares one completely (index_topk, index_n_heads and index_head_dim)."""
        if self.dsa_indexer is not None:
            return self.dsa_indexer
        return None not in (self.index_topk, self.index_n_heads, self.index_head_dim)

    def with_indexer_from(self, names: Iterable[str], prefix: str, where: str) -> "TextConfig":
        """This config with ``dsa_indexer`` decided by the tensor ``names`` (full names, text prefix
        ``prefix``): any ``...self_attn.indexer.*`` tensor means DSA. A checkpoint with indexer tensors
        needs the config's index_topk / index_n_heads / index_head_dim to run them."""
        example = min((n for n in names if n.startswith(prefix) and INDEXER_TENSOR.match(n, len(prefix))), default=None)
        if example is not None:
            absent = [k for k in ("index_topk", "index_n_heads", "index_head_dim") if getattr(self, k) is None]
            if absent:
                raise KimiQuantError(f"{where}: tensor {example!r} belongs to a DSA indexer, but config.json has "
                                     f"no {' / '.join(absent)} to run it with")
        return dataclasses.replace(self, dsa_indexer=example is not None)

    @property
    def latent_size(self) -> int:
        """Width the routed experts see: the latent size for a latent MoE, else hidden."""
        return int(self.routed_expert_hidden_size or self.hidden_size)
