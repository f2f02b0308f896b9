"""Plain-torch fp32 reference forward of the Kimi K3 / K3.1 family (architecture.md), layer-streamed.

The model is run one decoder layer at a time: ``embed`` makes the initial :class:`State`,
``layer_forward`` maps (one layer's weights, state) -> state, and ``head`` turns the final state into
logits. The state carried between layers is ``(x, blocks)`` (block attention residuals), never one
hidden vector, so only one layer's weights need to be in memory at a time.

Weights are passed as ``dict[str, Tensor]`` with names relative to the layer prefix
(``self_attn.q_proj.weight``, ``block_sparse_moe.experts.3.w1.weight``, ...) for a layer, and relative
to the text-model prefix (``model.embed_tokens.weight``, ``lm_head.weight``, ...) for the globals.
``act`` optionally maps a Linear weight name to an activation quantizer applied to that Linear's
input, the way the device does it: ``"int8"`` (per-token dynamic, symmetric, absmax/127, used by
W8A8_DYNAMIC / W4A8_DYNAMIC) or ``"mxfp8"`` (E4M3 elements with an E8M0 scale per block of 32 along K,
shared exponent = floor(log2(amax)) - 8, used by W8A8_MXFP8 / W4A8_MXFP).

Everything is differentiable (the tiny fixture is trained with it). Tensors are ``[B, T, ...]``.

Calibration uses this same forward: inside ``observe_linear_inputs(fn)`` every Linear calls
``fn(name, x)`` with its input (before any activation quantizer), which is how ``convert --calibrate``
collects each Linear's input Hessian without a second model implementation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import BadCheckpoint
from ..model.config import TextConfig
from . import kda

Weights = dict[str, torch.Tensor]

_LINEAR_OBSERVER: ContextVar[Callable[[str, torch.Tensor], None] | None] = ContextVar("linear_observer", default=None)


@contextmanager
def observe_linear_inputs(fn: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Within: ``fn(name, x)`` for the input ``x`` ([..., K], before activation quantization) of every
    Linear applied, ``name`` as in the weight dict (relative to the layer, or to the text prefix)."""
    token = _LINEAR_OBSERVER.set(fn)
    try:
        yield
    finally:
        _LINEAR_OBSERVER.reset(token)


def _observe(name: str | None, x: torch.Tensor) -> None:
    fn = _LINEAR_OBSERVER.get()
    if fn is not None and name is not None:
        fn(name, x)


# ------------------------------------------------------------------------------------------------
# activation quantizers (fake-quant: quantize then dequantize, fp32 out)
# ------------------------------------------------------------------------------------------------
def quant_act_int8(x: torch.Tensor) -> torch.Tensor:
    """int8 per-token dynamic symmetric: s = absmax(row)/127, q = round(x/s) in [-127, 127]."""
    s = x.abs().amax(dim=-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.clamp(torch.round(x / s), -127, 127) * s


def quant_act_mxfp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """MXFP8: per block of 32 along the last dim, E8M0 scale 2^(floor(log2(amax)) - 8), E4M3 elements."""
    K = x.shape[-1]
    if K % block:
        raise ValueError(f"MXFP8 activations need K divisible by {block}, got {K}")
    xb = x.reshape(*x.shape[:-1], K // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    e = torch.clamp(torch.floor(torch.log2(safe)) - 8, -127, 127)
    scale = torch.exp2(e)
    y = torch.clamp(xb / scale, -448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32) * scale
    return y.reshape(x.shape)


ACT_QUANT = {"int8": quant_act_int8, "mxfp8": quant_act_mxfp8}


# ------------------------------------------------------------------------------------------------
# small pieces
# ------------------------------------------------------------------------------------------------
def rmsnorm(x: torch.Tensor, w: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y * w if w is not None else y


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


def situ(a: torch.Tensor, b: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """SiTU(a, b) = [beta*tanh(a/beta)*sigmoid(a)] * [linear_beta*tanh(b/linear_beta)]; with
    ``linear_beta`` None the second factor is b itself."""
    up = b if linear_beta is None else linear_beta * torch.tanh(b / linear_beta)
    return (beta * torch.tanh(a / beta) * torch.sigmoid(a)) * up


class _Lin:
    """Applies named Linears from a weight dict, with the per-name activation quantizer if any."""

    def __init__(self, w: Weights, act: dict[str, str] | None):
        self.w = w
        self.act = act or {}

    def __call__(self, x: torch.Tensor, name: str) -> torch.Tensor:
        _observe(name, x)
        mode = self.act.get(name)
        if mode:
            x = ACT_QUANT[mode](x)
        return x @ self.w[name].t()


def _causal_conv_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, T, P], w [P, 1, K]: causal depthwise conv then SiLU."""
    T = x.shape[1]
    y = F.conv1d(x.transpose(1, 2), w, padding=w.shape[-1] - 1, groups=w.shape[0])[..., :T]
    return F.silu(y.transpose(1, 2))


def kda_attention(cfg: TextConfig, w: Weights, x: torch.Tensor, act=None, kda_impl: str = "chunked",
                  chunk_size: int = 64) -> torch.Tensor:
    lin = _Lin(w, act)
    B, T, _ = x.shape
    h, d = cfg.kda_num_heads, cfg.kda_head_dim
    q = _causal_conv_silu(lin(x, "self_attn.q_proj.weight"), w["self_attn.q_conv1d.weight"]).view(B, T, h, d)
    k = _causal_conv_silu(lin(x, "self_attn.k_proj.weight"), w["self_attn.k_conv1d.weight"]).view(B, T, h, d)
    v = _causal_conv_silu(lin(x, "self_attn.v_proj.weight"), w["self_attn.v_conv1d.weight"]).view(B, T, h, d)
    q = l2norm(q) * d ** -0.5
    k = l2norm(k)
    g = kda_decay(cfg, lin(lin(x, "self_attn.f_a_proj.weight"), "self_attn.f_b_proj.weight").view(B, T, h, d),
                  w["self_attn.A_log"], w["self_attn.dt_bias"].view(h, d))
    beta = torch.sigmoid(lin(x, "self_attn.b_proj.weight"))
    if kda_impl == "recurrent":
        o, _ = kda.kda_recurrent(q, k, v, g, beta)
    else:
        o, _ = kda.kda_chunked(q, k, v, g, beta, chunk_size=chunk_size)
    o = rmsnorm(o, w["self_attn.o_norm.weight"], cfg.rms_norm_eps)
    if cfg.use_full_rank_gate:
        gate = lin(x, "self_attn.g_proj.weight")
    else:  # low-rank output gate (Kimi Linear, K3 without use_full_rank_gate)
        gate = lin(lin(x, "self_attn.g_a_proj.weight"), "self_attn.g_b_proj.weight")
    o = o * torch.sigmoid(gate).view(B, T, h, d)
    return lin(o.reshape(B, T, h * d), "self_attn.o_proj.weight")


def kda_head_A_log(A_log: torch.Tensor, h: int, name: str) -> torch.Tensor:
    """The h per-head values of a stored ``A_log``: [h] (the official module), [1, 1, h, 1] (FLA / Kimi
    Linear) or padded past h with zeros (the K3 release pads to 128). Anything stored in the padding
    means the tensor is not laid out as assumed, so it is refused rather than cut off."""
    flat = A_log.reshape(-1)
    tail = flat[h:]
    if flat.numel() < h or bool(tail.detach().ne(0).any()):
        why = f"only {flat.numel()} values" if flat.numel() < h else \
            f"non-zero values past the first {h} (largest {float(tail.detach().abs().max()):.4g})"
        raise BadCheckpoint(f"tensor {name!r} {list(A_log.shape)} has {why}: A_log holds one value per KDA head "
                            f"({h}), optionally padded with zeros")
    return flat[:h]


def kda_decay(cfg: TextConfig, f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Per-channel log decay g <= 0 from the forget-gate projection f [B, T, h, d] (FLA's kda gate).

    With ``gate_lower_bound`` lb (K3): g = lb * sigmoid(exp(A_log) * (f + dt_bias)), in [lb, 0].
    Without (Kimi Linear): g = -exp(A_log) * softplus(f + dt_bias). A_log holds one value per head
    (:func:`kda_head_A_log`)."""
    h = f.shape[-2]
    A = torch.exp(kda_head_A_log(A_log, h, "self_attn.A_log")).view(h, 1)
    z = f + dt_bias
    if cfg.gate_lower_bound is None:
        return -A * F.softplus(z)
    return -abs(cfg.gate_lower_bound) * torch.sigmoid(A * z)


# ------------------------------------------------------------------------------------------------
# gated NoPE MLA with the optional DSA lightning indexer
# ------------------------------------------------------------------------------------------------
def rope_half(x: torch.Tensor, positions: torch.Tensor, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Non-interleaved (half-split) RoPE on the first ``dim`` channels of x [..., T, heads?, D]; x is [B, T, *, D]."""
    half = dim // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) * 2.0 / dim)
    ang = positions.to(torch.float32)[:, None] * inv[None, :]  # [T, half]
    shape = [1, x.shape[1]] + [1] * (x.dim() - 3) + [half]
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2, rest = x[..., :half], x[..., half:dim], x[..., dim:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


def indexer_scores(cfg: TextConfig, w: Weights, x: torch.Tensor, qr: torch.Tensor, act=None) -> torch.Tensor:
    """DSA lightning-indexer scores I[b, s, t] (causal entries only meaningful)."""
    lin = _Lin(w, act)
    B, T, _ = x.shape
    ih, idd = int(cfg.index_n_heads), int(cfg.index_head_dim)
    dr = cfg.qk_rope_head_dim
    theta = float(cfg.raw.get("rope_theta", 10000.0))
    pos = torch.arange(T, device=x.device)
    qi = lin(qr, "self_attn.indexer.wq_b.weight").view(B, T, ih, idd)
    ki = F.layer_norm(lin(x, "self_attn.indexer.wk.weight"), (idd,), w["self_attn.indexer.k_norm.weight"],
                      w["self_attn.indexer.k_norm.bias"], eps=1e-6)
    qi = rope_half(qi, pos, dr, theta)
    ki = rope_half(ki, pos, dr, theta)
    wts = lin(x, "self_attn.indexer.weights_proj.weight") * ih ** -0.5  # [B, T, ih]
    dots = torch.relu(torch.einsum("bshd,btd->bsht", qi, ki)) * idd ** -0.5
    return torch.einsum("bsht,bsh->bst", dots, wts)


def topk_mask(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Causal top-k keep mask from indexer scores [B, S, T]: True where kept."""
    T = scores.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
    if topk >= T:
        return causal.expand_as(scores).clone()
    s = scores.masked_fill(~causal, -math.inf)
    idx = s.topk(topk, dim=-1).indices
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)
    return keep & causal


def mla_attention(cfg: TextConfig, w: Weights, x: torch.Tensor, act=None) -> torch.Tensor:
    lin = _Lin(w, act)
    B, T, _ = x.shape
    nh, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    eps = cfg.mla_kv_norm_eps
    if cfg.q_lora_rank is None:  # Kimi Linear: one q_proj, no query latent (and so no DSA indexer)
        qr = None
        q = lin(x, "self_attn.q_proj.weight").view(B, T, nh, dn + dr)
    else:
        qr = rmsnorm(lin(x, "self_attn.q_a_proj.weight"), w["self_attn.q_a_layernorm.weight"], eps)
        q = lin(qr, "self_attn.q_b_proj.weight").view(B, T, nh, dn + dr)
    ckv = lin(x, "self_attn.kv_a_proj_with_mqa.weight")
    c, k_pe = ckv[..., :cfg.kv_lora_rank], ckv[..., cfg.kv_lora_rank:]
    c = rmsnorm(c, w["self_attn.kv_a_layernorm.weight"], eps)
    kv = lin(c, "self_attn.kv_b_proj.weight").view(B, T, nh, dn + dv)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, T, nh, dr)], dim=-1)
    scores = torch.einsum("bshd,bthd->bhst", q, k) * (dn + dr) ** -0.5
    if cfg.has_indexer and qr is not None:
        keep = topk_mask(indexer_scores(cfg, w, x, qr, act), int(cfg.index_topk)).unsqueeze(1)
    else:
        keep = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~keep, -math.inf)
    o = torch.einsum("bhst,bthd->bshd", torch.softmax(scores, dim=-1), v).reshape(B, T, nh * dv)
    if cfg.mla_use_output_gate:
        o = o * torch.sigmoid(lin(x, "self_attn.g_proj.weight"))
    return lin(o, "self_attn.o_proj.weight")


# ------------------------------------------------------------------------------------------------
# MLPs: dense SiTU MLP, sigmoid router, latent MoE
# ------------------------------------------------------------------------------------------------
def glu(cfg: TextConfig, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """SiTU for K3 (``hidden_act: situ``); SwiGLU for ``silu`` (Kimi Linear, and the official default)."""
    if cfg.hidden_act == "silu":
        return F.silu(a) * b
    return situ(a, b, cfg.situ_beta, cfg.situ_linear_beta)


def dense_mlp(cfg: TextConfig, w: Weights, x: torch.Tensor, prefix: str, act=None) -> torch.Tensor:
    lin = _Lin(w, act)
    a = lin(x, prefix + "gate_proj.weight")
    b = lin(x, prefix + "up_proj.weight")
    return lin(glu(cfg, a, b), prefix + "down_proj.weight")


def route(cfg: TextConfig, gate_w: torch.Tensor, bias: torch.Tensor, x: torch.Tensor):
    """Group-limited sigmoid router (DeepSeek-V3 ``noaux_tc``): (indices [.., k], weights [.., k]).

    s = sigmoid(x W^T); the choice uses s + e_score_correction_bias. With ``num_expert_group`` G > 1
    the experts form G equal groups, a group scores the sum of its two best biased scores, and only
    the ``topk_group`` best groups compete for the top k. Weights are the unbiased s of the chosen
    experts, renormalized if ``moe_renormalize`` and k > 1 (a lone expert keeps its score, as in the
    official router), times ``routed_scaling_factor``."""
    s = torch.sigmoid(F.linear(x, gate_w))
    choice = s + bias
    G = cfg.num_expert_group
    if G > 1 and cfg.topk_group < G:
        grouped = choice.unflatten(-1, (G, cfg.num_experts // G))
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = group_score.topk(cfg.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter(-1, kept, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), -math.inf).flatten(-2)
    idx = choice.topk(cfg.num_experts_per_token, dim=-1).indices
    wts = s.gather(-1, idx)
    if cfg.moe_renormalize and cfg.num_experts_per_token > 1:
        wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, wts * cfg.routed_scaling_factor


def _linear(x: torch.Tensor, wt: torch.Tensor, mode: str | None, name: str | None = None) -> torch.Tensor:
    """``x @ wt.T`` with the activation quantizer ``mode`` (or none) applied to x first (as _Lin)."""
    _observe(name, x)
    if mode:
        x = ACT_QUANT[mode](x)
    return x @ wt.t()


def moe(cfg: TextConfig, w: Weights, x: torch.Tensor, act=None, dense: bool = False) -> torch.Tensor:
    """Latent MoE. ``dense=True`` (training path) runs every expert on every token and weights the
    outputs by the (mostly zero) routing matrix: same result, no gather/scatter."""
    if not (dense and not act):
        return moe_many(cfg, w, [x], act)[0]
    lin = _Lin(w, act)
    M = "block_sparse_moe."
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    idx, wts = route(cfg, w[M + "gate.weight"], w[M + "gate.e_score_correction_bias"], xf)
    latent = bool(cfg.routed_expert_hidden_size)
    z = lin(xf, M + "routed_expert_down_proj.weight") if latent else xf
    W1 = torch.stack([w[f"{M}experts.{e}.w1.weight"] for e in range(cfg.num_experts)])
    W3 = torch.stack([w[f"{M}experts.{e}.w3.weight"] for e in range(cfg.num_experts)])
    W2 = torch.stack([w[f"{M}experts.{e}.w2.weight"] for e in range(cfg.num_experts)])
    he = glu(cfg, torch.einsum("nr,eir->eni", z, W1), torch.einsum("nr,eir->eni", z, W3))
    R = torch.zeros(z.shape[0], cfg.num_experts, dtype=z.dtype, device=z.device).scatter(1, idx, wts)
    y = torch.einsum("eni,eri,ne->nr", he, W2, R)
    return _moe_out(cfg, w, lin, M, y, xf, latent, act).reshape(shape)


def _moe_out(cfg, w, lin, M, y, xf, latent, act):
    if latent:
        if cfg.latent_moe_use_norm:
            y = rmsnorm(y, w[M + "routed_expert_norm.weight"], cfg.rms_norm_eps)
        y = lin(y, M + "routed_expert_up_proj.weight")
    if cfg.num_shared_experts:
        y = y + dense_mlp(cfg, w, xf, M + "shared_experts.", act)
    return y


def moe_many(cfg: TextConfig, w: Weights, xs: list[torch.Tensor], act=None,
             experts: Collection[int] | None = None, routing: list | None = None) -> list[torch.Tensor]:
    """Latent MoE on several token batches, expert-major: each routed expert's w1/w3/w2 is read from
    ``w`` once (``w`` may be a lazy mapping that loads it on access), only if the router sends it
    tokens in some batch, applied to every batch, then dropped. Per batch the arithmetic is exactly
    that of a batch-at-a-time loop (same shapes, experts accumulated in ascending order), so results
    do not depend on how many batches are passed together.

    ``experts``: only these routed experts run (the outputs are then partial and not for use: calibration
    runs none of them when it only needs their input and the non-routed Linears').

    ``routing``: a list to which each batch's ``(z, idx, wts)`` is appended: the routed experts' input [n, R]
    (the latent projection's output), the chosen experts [n, k] and their weights [n, k] (calibration hands
    each expert its rows, ``z[(idx == e).any(-1)]``, to the worker that quantizes it)."""
    lin = _Lin(w, act)
    act = act or {}
    M = "block_sparse_moe."
    latent = bool(cfg.routed_expert_hidden_size)
    shapes, xfs, routes, zs, ys = [], [], [], [], []
    for x in xs:
        shapes.append(x.shape)
        xf = x.reshape(-1, x.shape[-1])
        xfs.append(xf)
        idx, wts = route(cfg, w[M + "gate.weight"], w[M + "gate.e_score_correction_bias"], xf)
        routes.append((idx, wts))
        z = lin(xf, M + "routed_expert_down_proj.weight") if latent else xf
        zs.append(z)
        ys.append(z.new_zeros(z.shape))
        if routing is not None:
            routing.append((z, idx, wts))
    used = torch.unique(torch.cat([idx.reshape(-1) for idx, _ in routes])) if routes else torch.empty(0)
    for e in sorted(used.tolist()):
        if experts is not None and e not in experts:
            continue
        E = f"{M}experts.{e}."
        W1, W3, W2 = w[E + "w1.weight"], w[E + "w3.weight"], w[E + "w2.weight"]
        m1, m3, m2 = act.get(E + "w1.weight"), act.get(E + "w3.weight"), act.get(E + "w2.weight")
        n1, n3, n2 = E + "w1.weight", E + "w3.weight", E + "w2.weight"
        for b, ((idx, wts), z) in enumerate(zip(routes, zs)):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            ze = z[tok]
            he = glu(cfg, _linear(ze, W1, m1, n1), _linear(ze, W3, m3, n3))
            ys[b] = ys[b].index_add(0, tok, _linear(he, W2, m2, n2) * wts[tok, slot].unsqueeze(-1))
        del W1, W3, W2
    return [_moe_out(cfg, w, lin, M, y, xf, latent, act).reshape(shape)
            for y, xf, shape in zip(ys, xfs, shapes)]


# ------------------------------------------------------------------------------------------------
# block attention residuals and the layer-streamed model
# ------------------------------------------------------------------------------------------------
def attn_res_mix(blocks: list[torch.Tensor], p: torch.Tensor, proj: torch.Tensor, norm: torch.Tensor,
                 eps: float = 1e-5) -> torch.Tensor:
    """sum_k softmax_k(<rmsnorm(v_k), norm * proj[0]>) v_k over v = blocks + [p] (p alone if no blocks)."""
    if not blocks:
        return p
    vals = torch.stack(list(blocks) + [p], dim=0)  # [n, B, T, H]
    logits = (rmsnorm(vals, None, eps) * (norm * proj[0])).sum(-1)
    return (torch.softmax(logits, dim=0).unsqueeze(-1) * vals).sum(0)


@dataclass
class State:
    """What flows between decoder layers: the running residual x and the closed residual blocks."""

    x: torch.Tensor
    blocks: list[torch.Tensor] = field(default_factory=list)


def embed(gw: Weights, ids: torch.Tensor) -> State:
    return State(F.embedding(ids, gw["model.embed_tokens.weight"]), [])


def layer_forward(cfg: TextConfig, i: int, w: Weights, state: State, act: dict[str, str] | None = None,
                  kda_impl: str = "chunked", chunk_size: int = 64, moe_dense: bool = False) -> State:
    """Decoder layer ``i`` on the carried state, with this layer's weights only (names relative to the layer)."""
    p, blocks, h2n = _layer_attn(cfg, i, w, state, act, kda_impl, chunk_size)
    m = dense_mlp(cfg, w, h2n, "mlp.", act) if cfg.is_dense(i) else moe(cfg, w, h2n, act, moe_dense)
    return State(p + m, blocks)


def layers_forward(cfg: TextConfig, i: int, w: Weights, states: list[State], act: dict[str, str] | None = None,
                   kda_impl: str = "chunked", chunk_size: int = 64) -> list[State]:
    """``layer_forward`` on several token batches at once (bit-identical per batch). The MoE runs
    expert-major over all batches (:func:`moe_many`), so with a lazy weight mapping each routed expert
    is loaded once per layer and only one expert's weights are materialized at a time."""
    return layers_mlp(cfg, i, w, layers_attention(cfg, i, w, states, act, kda_impl, chunk_size), act)


def layers_attention(cfg: TextConfig, i: int, w: Weights, states: list[State], act: dict[str, str] | None = None,
                     kda_impl: str = "chunked", chunk_size: int = 64) -> list[tuple]:
    """First half of ``layers_forward``: per batch (residual, blocks, normalized MLP input)."""
    return [_layer_attn(cfg, i, w, st, act, kda_impl, chunk_size) for st in states]


def layers_mlp(cfg: TextConfig, i: int, w: Weights, parts: list[tuple], act: dict[str, str] | None = None,
               experts: Collection[int] | None = None, routing: list | None = None) -> list[State]:
    """Second half of ``layers_forward``: the MLP (dense or MoE) on ``layers_attention``'s output
    (``experts``, ``routing``: as in ``moe_many``; a dense layer has neither)."""
    if cfg.is_dense(i):
        ms = [dense_mlp(cfg, w, h2n, "mlp.", act) for _, _, h2n in parts]
    else:
        ms = moe_many(cfg, w, [h2n for _, _, h2n in parts], act, experts=experts, routing=routing)
    return [State(p + m, blocks) for (p, blocks, _), m in zip(parts, ms)]


def _layer_attn(cfg: TextConfig, i: int, w: Weights, state: State, act, kda_impl: str, chunk_size: int):
    """Everything of layer i up to the MLP input: (residual p, blocks, normalized MLP input)."""
    eps = cfg.rms_norm_eps
    Bsz = cfg.attn_res_block_size or 0
    blocks = list(state.blocks)
    p = state.x
    h = attn_res_mix(blocks, p, w["self_attention_res_proj.weight"], w["self_attention_res_norm.weight"], eps) \
        if Bsz else p
    if Bsz and i % Bsz == 0:
        blocks.append(p)
        p = None
    hn = rmsnorm(h, w["input_layernorm.weight"], eps)
    if cfg.is_kda(i) and not cfg.is_full_attn(i):
        kda_head_A_log(w["self_attn.A_log"], cfg.kda_num_heads, f"model.layers.{i}.self_attn.A_log")  # named refusal
        a = kda_attention(cfg, w, hn, act, kda_impl, chunk_size)
    else:
        a = mla_attention(cfg, w, hn, act)
    p = a if p is None else p + a
    h2 = attn_res_mix(blocks, p, w["mlp_res_proj.weight"], w["mlp_res_norm.weight"], eps) if Bsz else p
    return p, blocks, rmsnorm(h2, w["post_attention_layernorm.weight"], eps)


def head(cfg: TextConfig, gw: Weights, state: State, act: dict[str, str] | None = None) -> torch.Tensor:
    eps = cfg.rms_norm_eps
    x = state.x
    if cfg.attn_res_block_size:
        x = attn_res_mix(state.blocks, x, gw["model.output_attn_res_proj.weight"],
                         gw["model.output_attn_res_norm.weight"], eps)
    x = rmsnorm(x, gw["model.norm.weight"], eps)
    return _Lin(gw, act)(x, "lm_head.weight")


def forward(cfg: TextConfig, gw: Weights, layers: list[Weights], ids: torch.Tensor, **kw) -> torch.Tensor:
    """Whole-model logits [B, T, V] from in-memory weights (training and tests; streaming uses the parts)."""
    st = embed(gw, ids)
    for i, w in enumerate(layers):
        st = layer_forward(cfg, i, w, st, **kw)
    return head(cfg, gw, st)


def split_weights(cfg: TextConfig, tensors: dict[str, torch.Tensor], prefix: str = "language_model.") \
        -> tuple[Weights, list[Weights]]:
    """Full-name tensors -> (globals relative to ``prefix``, per-layer dicts relative to the layer prefix)."""
    gw: Weights = {}
    layers: list[Weights] = [{} for _ in range(cfg.num_hidden_layers)]
    lp = prefix + "model.layers."
    for name, t in tensors.items():
        if name.startswith(lp):
            rest = name[len(lp):]
            i, rel = rest.split(".", 1)
            layers[int(i)][rel] = t
        elif name.startswith(prefix):
            gw[name[len(prefix):]] = t
    return gw, layers
