"""config.json for the synthetic presets: same names and structure as Kimi K3.1, small dimensions.

``tiny``: the architecture.md tiny variant (hidden 128, layers KDA,KDA,KDA,DSA,KDA,DSA).
``bench``: realistic expert matrix shapes ([3072, 3584] latent experts) and a GB-sized checkpoint,
for throughput and memory benchmarks.
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import KimiQuantError

_TINY_TEXT: dict[str, Any] = {
    "model_type": "kimi_k3_text",
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_hidden_layers": 6,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 8,
    "indexer_rope_interleave": False,
    "num_experts": 16,
    "num_experts_per_token": 4,
    "num_shared_experts": 2,
    "moe_intermediate_size": 64,  # W4A8_MXFP needs K % 64 == 0 (expert w2 K = this)
    "routed_expert_hidden_size": 64,
    "latent_moe_use_norm": True,
    "first_k_dense_replace": 1,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "num_expert_group": 1,
    "topk_group": 1,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-5,
    "attn_res_block_size": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "linear_attn_config": {
        "num_heads": 4,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
        "full_attn_layers": [4, 6],
        "kda_layers": [1, 2, 3, 5],
    },
}

_BENCH_OVERRIDES: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 2048,
    "num_hidden_layers": 3,
    "intermediate_size": 4096,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 512,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "index_n_heads": 8,
    "index_head_dim": 64,
    "index_topk": 64,
    "num_experts": 16,
    "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584,
    "num_shared_experts": 1,
    "attn_res_block_size": 2,
    "linear_attn_config": {
        "num_heads": 8,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
        "full_attn_layers": [3],
        "kda_layers": [1, 2],
    },
}


# Kimi K3.1 Pro at full size (architecture.md): only for header-only ("sparse") checkpoints that
# exercise planning on the real tensor inventory (~2.8T parameters) without the data.
_FULL_OVERRIDES: dict[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 7168,
    "num_hidden_layers": 93,
    "intermediate_size": 33792,
    "num_attention_heads": 96,
    "num_key_value_heads": 96,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_shared_experts": 2,
    "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584,
    "attn_res_block_size": 12,
    "max_position_embeddings": 1048576,
    "linear_attn_config": {
        "num_heads": 96,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
        "full_attn_layers": [*range(4, 93, 4), 93],
        "kda_layers": [i for i in range(1, 94) if i % 4 and i != 93],
    },
}


def _wrap(text: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "torch_dtype": "bfloat16",
        "text_config": text,
        "vision_config": {"model_type": "kimi_k3_vision", "hidden_size": text["hidden_size"], "patch_size": 14},
    }


def preset_config(name: str, num_experts: int | None = None) -> dict[str, Any]:
    """config.json for preset ``tiny`` or ``bench`` (``num_experts`` scales the checkpoint size)."""
    text = copy.deepcopy(_TINY_TEXT)
    if name == "bench":
        text.update(copy.deepcopy(_BENCH_OVERRIDES))
    elif name == "full":
        text.update(copy.deepcopy(_FULL_OVERRIDES))
    elif name != "tiny":
        raise ValueError(f"unknown preset {name!r} (tiny, bench, full)")
    if num_experts:
        if int(num_experts) < text["num_experts_per_token"]:
            raise KimiQuantError(f"--num-experts {num_experts}: preset {name} routes each token to "
                                 f"{text['num_experts_per_token']} experts, so it needs at least that many")
        text["num_experts"] = int(num_experts)
    return _wrap(text)


PRESETS = ("tiny", "bench", "full")
