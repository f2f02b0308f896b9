"""What the reference forward (``runtime.forward``) can run: config settings it cannot honour are
refused in one line instead of silently ignored."""

from __future__ import annotations

from ..errors import KimiQuantError
from ..model.config import TextConfig


def unsupported(cfg: TextConfig) -> list[str]:
    """Config settings this forward cannot honour (empty when it can run the model as configured)."""
    raw = cfg.raw
    out = []
    if cfg.router_scoring != "sigmoid":
        out.append(f"router scoring {cfg.router_scoring!r} (only 'sigmoid')")
    if cfg.topk_method != "noaux_tc":
        out.append(f"topk_method {cfg.topk_method!r} (only 'noaux_tc')")
    E, G, k = cfg.num_experts, cfg.num_expert_group, cfg.num_experts_per_token
    if G < 1 or E % G:
        out.append(f"num_expert_group {G} (must divide num_experts {E})")
    elif not 1 <= cfg.topk_group <= G:
        out.append(f"topk_group {cfg.topk_group} (must be 1..num_expert_group {G})")
    elif G > 1 and cfg.topk_group < G and (E // G < 2 or cfg.topk_group * (E // G) < k):
        out.append(f"num_expert_group {G} / topk_group {cfg.topk_group} (groups need >= 2 experts and the kept "
                   f"groups >= num_experts_per_token {k} experts)")
    if G > 1 and raw.get("use_grouped_topk") is False:
        out.append(f"use_grouped_topk false with num_expert_group {G} (consumers disagree on what that means)")
    if not 1 <= k <= E:
        out.append(f"num_experts_per_token {k} (must be 1..num_experts {E})")
    if cfg.hidden_act not in ("situ", "silu"):
        out.append(f"hidden_act {cfg.hidden_act!r} (only 'situ' and 'silu')")
    if raw.get("mla_use_nope") is False:
        out.append("mla_use_nope false (the MLA layers here apply no rotary embedding)")
    if raw.get("indexer_rope_interleave"):
        out.append("indexer_rope_interleave true (only half-split RoPE)")
    if cfg.has_indexer and cfg.q_lora_rank is None:
        out.append("a DSA indexer without q_lora_rank (the indexer reads the query latent)")
    if raw.get("moe_layer_freq", 1) != 1:
        out.append(f"moe_layer_freq {raw.get('moe_layer_freq')!r} (only 1: every layer after first_k_dense_replace is MoE)")
    if raw.get("tie_word_embeddings"):
        out.append("tie_word_embeddings true (a separate lm_head is expected)")
    return out


def check_supported(cfg: TextConfig) -> None:
    """Refuse, in one line, a config whose settings :func:`unsupported` lists, instead of ignoring them."""
    problems = unsupported(cfg)
    if problems:
        raise KimiQuantError("config.json: the reference forward cannot run this model as configured: "
                             + "; ".join(problems))
