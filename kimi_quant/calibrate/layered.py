"""The layer-ordered plan of a calibrated conversion.

A calibrated conversion quantizes layer by layer, so its units (output shards) are cut at layer
boundaries: layer 0's shards, layer 1's, ..., then one or more shards of everything outside the
decoder layers (embedding, final norms, lm_head, vision), written last because lm_head's Hessian
needs the final state. Inside a layer, tensors are ordered the way they are produced: attention
side first, then the MLP's non-routed Linears (dense MLP, shared experts, latent projections,
router), then the routed experts by index. Shard names, the index and the description are the
same kind as ``convert`` writes (``quant_model_weights-NNNNN-of-NNNNN.safetensors``; every tensor
has the same type either way); only which tensor lands in which shard differs.
"""

from __future__ import annotations

from dataclasses import replace

from ..model.spec import ModelSpec
from ..plan import OUTPUT_STEM, Plan, TensorPlan, UnitPlan

ATTENTION, MLP, EXPERTS = 0, 1, 2
GLOBAL = -1  # "layer" of tensors outside the decoder layers


def layer_of(spec: ModelSpec, name: str) -> int:
    layer = spec.role(name).layer
    return GLOBAL if layer is None else layer


def stage_of(spec: ModelSpec, name: str) -> tuple[int, int]:
    """(stage, expert index) of a tensor inside its layer: the order in which it is quantized."""
    role = spec.role(name)
    if role.expert is not None:
        return EXPERTS, role.expert
    rel = relative_name(spec, name)
    if rel.startswith(("mlp.", "block_sparse_moe.")):
        return MLP, -1
    return ATTENTION, -1


def relative_name(spec: ModelSpec, name: str) -> str:
    """The name the forward uses: relative to the layer prefix, or to the text prefix for globals."""
    rel = name[len(spec.prefix):] if name.startswith(spec.prefix) else name
    if rel.startswith("model.layers."):
        rel = rel.split(".", 3)[3]
    return rel


def layered_plan(plan: Plan, spec: ModelSpec, extra: dict) -> Plan:
    """``plan`` re-cut into layer-ordered units (same tensors, schemes and outputs); ``extra`` (the
    calibration settings and text) is recorded in the plan and so in its fingerprint."""
    order = {t.name: k for k, t in enumerate(plan.tensors())}
    n_layers = spec.text.num_hidden_layers

    def key(t: TensorPlan):
        layer = layer_of(spec, t.name)
        return (n_layers if layer == GLOBAL else layer, *stage_of(spec, t.name), order[t.name])

    tensors = sorted(plan.tensors(), key=key)
    shards: list[list[TensorPlan]] = []
    size, current = 0, None
    for t in tensors:
        layer = layer_of(spec, t.name)
        if not shards or layer != current or (shards[-1] and size + t.out_bytes > plan.max_shard_size):
            shards.append([])
            size, current = 0, layer
        shards[-1].append(t)
        size += t.out_bytes
    n = len(shards)
    units = [UnitPlan(f"{OUTPUT_STEM}-{i + 1:05d}-of-{n:05d}.safetensors", ts) for i, ts in enumerate(shards)]
    return replace(plan, units=units, extra={**plan.extra, **extra})


def units_by_layer(plan: Plan, spec: ModelSpec) -> dict[int, list[UnitPlan]]:
    """Layer (GLOBAL for the rest) -> its units, in plan order."""
    out: dict[int, list[UnitPlan]] = {}
    for u in plan.units:
        out.setdefault(layer_of(spec, u.tensors[0].name), []).append(u)
    return out
