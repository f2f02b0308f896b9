"""Small generated safetensors checkpoints for the hub tests."""

from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import save


def make_shards(n_shards: int = 3, tensors_per_shard: int = 3, rows: int = 64, cols: int = 128,
                seed: int = 0) -> dict[str, bytes]:
    """``{filename: bytes}`` for a sharded checkpoint: config, index and ``n_shards`` safetensors files."""
    rng = np.random.default_rng(seed)
    files: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(n_shards):
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        tensors = {}
        for t in range(tensors_per_shard):
            tname = f"model.layers.{s}.mlp.w{t}.weight"
            tensors[tname] = rng.integers(0, 2 ** 16, size=(rows, cols), dtype=np.uint16).view(np.float16)
            weight_map[tname] = name
            total += tensors[tname].nbytes
        files[name] = save(tensors, metadata={"format": "pt"})
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode()
    files["config.json"] = json.dumps({"model_type": "kimi_k3", "num_hidden_layers": n_shards}).encode()
    return files
