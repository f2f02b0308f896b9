"""KDA's gated delta rule with per-key-channel log-space decay: the token-by-token definition and the
chunked form the forward uses (the same outputs and final state, a few matmuls per chunk)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def kda_recurrent(q, k, v, g, beta, initial_state=None):
    """Token-by-token KDA recurrence (the definition).

    q, k: [B, T, h, dk] (q already scaled); v: [B, T, h, dv]; g: [B, T, h, dk] log decay (<= 0);
    beta: [B, T, h]. Per token: S = S*exp(g_t)[:, None]; S += outer(beta_t k_t, v_t - k_t^T S); o_t = q_t^T S.
    Returns (o [B, T, h, dv], final state [B, h, dk, dv]).
    """
    B, T, h, dk = k.shape
    dv = v.shape[-1]
    S = q.new_zeros(B, h, dk, dv) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        S = S * torch.exp(g[:, t]).unsqueeze(-1)
        kt = k[:, t]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t].unsqueeze(-1) * kt, v[:, t] - pred)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, dim=1), S


def kda_chunked(q, k, v, g, beta, chunk_size: int = 64, initial_state=None):
    """The same recurrence in chunks (WY form), exact up to fp32 rounding.

    Within a chunk with inclusive cumulative decay G_t, the state after token t is
    S_t = D_t S_0 + sum_{i<=t} diag(exp(G_t - G_i)) k_i u_i^T, where the pseudo-values u solve the
    unit lower-triangular system u_t + beta_t sum_{i<t} A_ti u_i = beta_t (v_t - (k_t e^{G_t})^T S_0),
    A_ti = sum_c k_t[c] k_i[c] exp(G_t[c] - G_i[c]). Pairwise decays are formed as exp of differences
    through sub-blocks (see below), so no decay, however strong, can overflow over a 64-token chunk.
    """
    B, T, h, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    if pad:
        # padded tokens: k = v = q = 0, beta = 0, g = 0 -> state and outputs untouched
        q, k, v, g = (F.pad(a, (0, 0, 0, 0, 0, pad)) for a in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // C
    # -> [B, h, N, C, d]
    q, k, v, g = (a.reshape(B, N, C, h, -1).permute(0, 3, 1, 2, 4) for a in (q, k, v, g))
    beta = beta.reshape(B, N, C, h).permute(0, 3, 1, 2)
    G = torch.cumsum(g, dim=3)
    # Pairwise decays exp(G_t - G_i) factor through r = the token just before t's sub-block of sb
    # tokens: exp(G_t - G_r) * exp(G_r - G_i). The left factor is in [e^-80, 1]; the right one is
    # <= e^80 for i inside t's sub-block and <= 1 before it (an underflow there is harmless: the true
    # value is at least as small); i after t's sub-block is masked. sb is chosen so that
    # sb * max|g| <= 80, so nothing overflows however strong the decay.
    gmax = float(-g.detach().min()) if g.numel() else 0.0
    sb = C
    while sb > 1 and sb * gmax > 80.0:
        sb //= 2
    while C % sb:
        sb -= 1
    J = C // sb
    Gref = torch.cat([torch.zeros_like(G[:, :, :, :1]), G[:, :, :, sb - 1:C - 1:sb]], dim=3)  # [B, h, N, J, dk]
    e_left = torch.exp(G - Gref.repeat_interleave(sb, dim=3)).reshape(B, h, N, J, sb, dk)
    sub = torch.arange(C, device=q.device) // sb
    after = (sub[None, :] > torch.arange(J, device=q.device)[:, None])[:, :, None]  # [J, C(i), 1]
    right = torch.exp((Gref.unsqueeze(4) - G.unsqueeze(3)).masked_fill(after, -math.inf)) * k.unsqueeze(3)
    A_kk = torch.einsum("bhnjsc,bhnjic->bhnjsi", k.reshape(B, h, N, J, sb, dk) * e_left, right).reshape(B, h, N, C, C)
    A_qk = torch.einsum("bhnjsc,bhnjic->bhnjsi", q.reshape(B, h, N, J, sb, dk) * e_left, right).reshape(B, h, N, C, C)
    idx = torch.arange(C, device=q.device)
    A_kk = A_kk * (idx[:, None] > idx[None, :])
    A_qk = A_qk * (idx[:, None] >= idx[None, :])
    Tm = beta.unsqueeze(-1) * A_kk  # strictly lower part of the unit lower-triangular system
    kg = k * torch.exp(G)
    rhs = torch.cat([beta.unsqueeze(-1) * v, beta.unsqueeze(-1) * kg], dim=-1)
    sol = unit_lower_solve(Tm, rhs)
    U0, W = sol[..., :dv], sol[..., dv:]  # u = U0 - W S_0
    # Everything but the chunk-to-chunk state recursion is batched over chunks:
    #   o     = (q e^G - A_qk W) S_0 + A_qk U0
    #   S_end = (diag(e^G_last) - K_end^T W) S_0 + K_end^T U0,  K_end = k e^(G_last - G)
    G_last = G[:, :, :, -1:, :]  # [B, h, N, 1, dk]
    kT = (k * torch.exp(G_last - G)).transpose(-1, -2)  # [B, h, N, dk, C]
    trans = torch.diag_embed(torch.exp(G_last.squeeze(-2))) - kT @ W  # [B, h, N, dk, dk]
    inject = kT @ U0  # [B, h, N, dk, dv]
    q_eff = q * torch.exp(G) - A_qk @ W
    o0 = A_qk @ U0
    S = q.new_zeros(B, h, dk, dv) if initial_state is None else initial_state
    starts = []
    for tr, inj in zip(trans.unbind(2), inject.unbind(2)):
        starts.append(S)
        S = tr @ S + inj
    o = q_eff @ torch.stack(starts, dim=2) + o0  # [B, h, N, C, dv]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, h, dv)[:, :T]
    return o, S


def unit_lower_solve(L: torch.Tensor, R: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Solve (I + L) X = R, L strictly lower-triangular [..., C, C], batched over the leading dims.

    The diagonal blocks (16 x 16) are inverted by row-wise forward substitution, all blocks at once,
    then the blocks are solved in order. torch's batched CPU triangular solve is an order of magnitude
    slower for many small systems, and this stays differentiable (no in-place writes).
    """
    C = L.shape[-1]
    bs = min(block, C)
    while C % bs:
        bs -= 1
    nb = C // bs
    lead = L.shape[:-2]
    D = torch.diagonal(L.reshape(*lead, nb, bs, nb, bs), dim1=-4, dim2=-2)  # [..., bs, bs, nb]
    D = D.permute(*range(len(lead)), -1, -3, -2)  # [..., nb, bs, bs]
    eye = torch.eye(bs, dtype=L.dtype, device=L.device)
    rows = [eye[0].expand(*D.shape[:-2], bs)]
    for t in range(1, bs):
        prev = torch.stack(rows, dim=-2)
        rows.append(eye[t] - (D[..., t:t + 1, :t] @ prev).squeeze(-2))
    Dinv = torch.stack(rows, dim=-2)  # (I + D)^-1 per diagonal block
    xs: list[torch.Tensor] = []
    for j in range(nb):
        r = R[..., j * bs:(j + 1) * bs, :]
        if j:
            r = r - L[..., j * bs:(j + 1) * bs, :j * bs] @ torch.cat(xs, dim=-2)
        xs.append(Dinv[..., j, :, :] @ r)
    return torch.cat(xs, dim=-2)
