"""``plan --calibrate``: time and memory of a calibrated conversion, from the plan and two measurements.

Time = forward + Hessians + GPTQ, in core-seconds, divided by the cores:

* forward: 2 FLOPs per active weight per token, times the passes the driver makes over a layer
  (attention twice: observed, then re-run quantized; the MLP twice: observed and output, plus one
  more over the routed experts when they are observed in several batches), at the fp32 matmul rate
  measured here on one core;
* Hessians: 2 K^2 FLOPs per token per Linear input (q/k/v and w1/w3 share theirs; a routed expert
  only from its own tokens: k/E of them), at the fp64 rate measured here;
* GPTQ: measured here per scheme on a [256, 512] and a [1024, 2048] matrix, fitted to
  a K + b (N K^2 + K^3) (per-column steps; the update and Cholesky arithmetic) and summed over the plan.

Memory is the formula in :mod:`kimi_quant.calibrate.run`, evaluated for this model, per worker (the
calibrated run is one process: its driver state and, at its peak, the GPTQ of the plan's largest
matrix with that matrix's Hessian as handed over).
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from ..plan import Plan
from ..recipe.recipe import FLOAT
from .config import CalibConfig
from .layered import EXPERTS, GLOBAL, layer_of, stage_of

PROBE = (1024, 2048)


def _rate(dtype, n: int = 512) -> float:
    """FLOP/s of one n^3 matmul on one thread (best of 3)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(n, n, dtype=dtype)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return 2 * n ** 3 / best


def _gptq_seconds(scheme: str, matmul: str | None, n: int, k: int) -> float:
    """One-core seconds of GPTQ on an [n, k] matrix in ``scheme``."""
    import torch

    from ..quant import get_codec
    from ..quant.gptq import gptq_quantize

    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    x = rng.standard_normal((2 * k, k))
    h = x.T @ x / len(x)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = time.perf_counter()
        gptq_quantize(get_codec(scheme), w, matmul, h)
        return time.perf_counter() - t
    finally:
        torch.set_num_threads(threads)


def gptq_model(scheme: str, matmul: str | None) -> tuple[float, float]:
    """(a, b) of t(N, K) = a K + b (N K^2 + K^3) seconds on one core, fitted to two measured sizes:
    GPTQ walks the K columns one at a time (a fixed cost each) and does O(N K^2 + K^3) arithmetic."""
    sizes = [(256, 512), PROBE]
    _gptq_seconds(scheme, matmul, 8, 64)  # loads the kernels: not part of either probe
    ts = [_gptq_seconds(scheme, matmul, n, k) for n, k in sizes]
    A = np.array([[k, n * k * k + k ** 3] for n, k in sizes], dtype=np.float64)
    a, b = np.linalg.solve(A, np.array(ts))
    if a < 0 or b < 0:  # noise: fall back to the pure FLOP model through the larger probe
        n, k = PROBE
        return 0.0, ts[1] / (n * k * k + k ** 3)
    return float(a), float(b)


def estimate(plan: Plan, spec, cfg: CalibConfig, workers: int) -> dict:
    """{hours, core_hours, forward_core_h, hessian_core_h, gptq_core_h, memory_bytes, ...} for ``plan``."""
    t = spec.text
    T = cfg.tokens
    k, E = t.num_experts_per_token, t.num_experts
    flops_fwd = 0.0  # per token, all passes
    flops_h = 0.0  # per token
    gptq_cost = defaultdict(lambda: np.zeros(2))  # scheme -> sums of (K, N K^2 + K^3)
    probe = {}
    per_layer_nonexpert = defaultdict(int)
    expert_bytes = 0
    seen_inputs = set()
    gptq_peak, gptq_peak_name = 0, None
    for tp in plan.tensors():
        if len(tp.shape) != 2:
            continue
        N, K = tp.shape
        layer = layer_of(spec, tp.name)
        stage, expert = stage_of(spec, tp.name)
        role = spec.role(tp.name)
        if not role.linear:
            continue
        share = k / E if stage == EXPERTS else 1.0
        passes = 2.0 if layer == GLOBAL else (3.0 if stage == EXPERTS and E > cfg.expert_batch else 2.0)
        flops_fwd += 2 * N * K * share * passes
        if stage == EXPERTS:
            expert_bytes = max(expert_bytes, N * K * 4 * 3)
        elif layer != GLOBAL:
            per_layer_nonexpert[layer] += N * K * 4
        if tp.scheme != FLOAT:
            # Linears fed the same input share one Hessian (q/k/v of a layer, w1/w3 of an expert)
            key = (layer, expert, K, role.matmul in ("gate", "up") or role.role == "kda.qkv_proj")
            if key not in seen_inputs or not key[3]:
                seen_inputs.add(key)
                flops_h += 2 * K * K * share
            gptq_cost[tp.scheme] += np.array([K, N * K * K + K ** 3], dtype=np.float64)
            probe.setdefault(tp.scheme, tp.matmul)
            job = gptq_job_bytes(N, K)
            if job > gptq_peak:
                gptq_peak, gptq_peak_name = job, tp.name
    fp32, fp64 = _rate(__import__("torch").float32), _rate(__import__("torch").float64)
    gptq_s = 0.0
    per_expert = {}
    for scheme, cost in gptq_cost.items():
        a, b = gptq_model(scheme, probe[scheme])
        gptq_s += a * cost[0] + b * cost[1]
        R, I = t.latent_size, t.moe_intermediate_size
        per_expert[scheme] = a * R + b * (I * R * R + R ** 3)  # one [I, R] expert matrix (w1 / w3)
    fwd_s = flops_fwd * T / fp32
    hess_s = flops_h * T / fp32  # x^T x is formed in float32 (calibrate.hessian), summed in float64
    core_s = fwd_s + hess_s + gptq_s
    return {"hours": core_s / max(1, workers) / 3600, "core_hours": core_s / 3600, "workers": workers,
            "forward_core_h": fwd_s / 3600, "hessian_core_h": hess_s / 3600, "gptq_core_h": gptq_s / 3600,
            "fp32_gflops": fp32 / 1e9, "fp64_gflops": fp64 / 1e9,
            "gptq_s_per_expert_matrix": per_expert,
            "memory_bytes": memory_bytes(spec, cfg, max(per_layer_nonexpert.values(), default=0), expert_bytes,
                                         gptq_peak),
            "gptq_memory_bytes": gptq_peak, "gptq_memory_tensor": gptq_peak_name}


def gptq_job_bytes(N: int, K: int) -> int:
    """Memory of quantizing one [N, K] Linear with GPTQ: its weight (float32), its Hessian as the
    collector hands it over (float64, a new array beside the collector's own sum) and GPTQ's working
    set (``gptq.working_set_bytes``: one K x K float32 matrix above K 8192, row chunks, codes)."""
    from ..quant.gptq import working_set_bytes

    return 4 * N * K + 8 * K * K + working_set_bytes(N, K)


def memory_bytes(spec, cfg: CalibConfig, layer_nonexpert_f32: int, expert_f32: int, gptq_job: int) -> int:
    """The resident-memory formula of :mod:`kimi_quant.calibrate.run` for this model (one worker):
    the driver's state, the Hessian sums being collected, and the largest GPTQ job (``gptq_job``,
    ``gptq_job_bytes`` of the plan's largest quantized matrix)."""
    t = spec.text
    T, H = cfg.tokens, t.hidden_size
    R, I, k = t.latent_size, t.moe_intermediate_size, t.num_experts_per_token
    blocks = -(-t.num_hidden_layers // t.attn_res_block_size) if t.attn_res_block_size else 0
    states = T * H * 4 * (2 + blocks) * 2
    routed = T * k * (R + I) * 4
    windows = max(1, T // cfg.seq_len)
    heads = max(t.num_attention_heads, t.kda_num_heads)
    attention = windows * heads * cfg.seq_len ** 2 * 4 * 2
    # float64 sums held while a stage is quantized: the attention side (~3 H^2), a dense MLP (gate/up
    # share one: H^2, its down projection: intermediate^2), or a MoE layer's non-routed Linears + a
    # batch of experts
    dense = H * H + (t.intermediate_size or 0) ** 2
    moe = cfg.expert_batch * (R * R + I * I) + 2 * H * H + (I * t.num_shared_experts) ** 2
    hessians = max(3 * H * H, dense, moe) * 8
    return int(layer_nonexpert_f32 + 2 * expert_f32 + states + routed + attention + hessians + gptq_job + 300e6)
