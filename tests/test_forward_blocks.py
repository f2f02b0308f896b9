"""Each block of the reference forward against a naive re-statement of architecture.md."""

import math

import pytest
import torch

from kimi_quant.model.presets import preset_config
from kimi_quant.model.spec import spec_from_config
from kimi_quant.runtime import forward as fw
from kimi_quant.runtime import kda

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seeded():
    """Each test draws from the global generator from the same seed, whatever ran before it (CI once drew an
    input 1.8e-5 apart from a test that ran alone)."""
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def cfg():
    return spec_from_config(preset_config("tiny")).text


def _rand_layer(cfg, i, seed=0):
    g = torch.Generator().manual_seed(seed)
    spec = spec_from_config(preset_config("tiny"))
    lp = f"language_model.model.layers.{i}."
    w = {}
    for name, (shape, _) in spec.expected_tensors(with_vision=False).items():
        if name.startswith(lp):
            rel = name[len(lp):]
            t = torch.randn(shape, generator=g) * (shape[-1] ** -0.5 if len(shape) > 1 else 0.3)
            if rel.endswith(("norm.weight", "layernorm.weight")):
                t = 1.0 + 0.1 * torch.randn(shape, generator=g)
            if rel.endswith("dt_bias"):
                t = -3.0 + torch.randn(shape, generator=g)
            if rel.endswith("A_log"):  # one value per head, zero padding (as the K3 release stores it)
                t[cfg.kda_num_heads:] = 0
            w[rel] = t
    return w


def _kda_inputs(B=2, T=150, h=3, dk=16, dv=24, seed=0, glow=-5.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, h, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, h, dk, generator=g), dim=-1)
    v = torch.randn(B, T, h, dv, generator=g)
    gg = glow * torch.rand(B, T, h, dk, generator=g)
    beta = torch.rand(B, T, h, generator=g)
    return q, k, v, gg, beta


@pytest.mark.parametrize("chunk", [64, 16, 7])
@pytest.mark.parametrize("glow", [-5.0, -0.01, -40.0])
def test_kda_chunked_equals_recurrent(chunk, glow):
    q, k, v, g, beta = _kda_inputs(glow=glow)
    o1, s1 = kda.kda_recurrent(q, k, v, g, beta)
    o2, s2 = kda.kda_chunked(q, k, v, g, beta, chunk_size=chunk)
    assert torch.allclose(o1, o2, atol=2e-5, rtol=1e-4)
    assert torch.allclose(s1, s2, atol=2e-5, rtol=1e-4)


def test_kda_recurrent_matches_per_head_loop():
    """The batched recurrence against the literal per-token, per-head statement."""
    q, k, v, g, beta = _kda_inputs(B=1, T=20, h=2, dk=4, dv=3)
    o, _ = kda.kda_recurrent(q, k, v, g, beta)
    for hh in range(2):
        S = torch.zeros(4, 3)
        for t in range(20):
            S = S * torch.exp(g[0, t, hh])[:, None]
            kt, vt = k[0, t, hh], v[0, t, hh]
            S = S + torch.outer(beta[0, t, hh] * kt, vt - kt @ S)
            assert torch.allclose(o[0, t, hh], q[0, t, hh] @ S, atol=1e-6)


def test_kda_chunked_with_initial_state():
    q, k, v, g, beta = _kda_inputs(T=90)
    s0 = torch.randn(2, 3, 16, 24) * 0.1
    o1, s1 = kda.kda_recurrent(q, k, v, g, beta, initial_state=s0)
    o2, s2 = kda.kda_chunked(q, k, v, g, beta, initial_state=s0)
    assert torch.allclose(o1, o2, atol=2e-5) and torch.allclose(s1, s2, atol=2e-5)


def test_kda_layer_recurrent_vs_chunked(cfg):
    w = _rand_layer(cfg, 0)
    x = torch.randn(2, 70, cfg.hidden_size)
    a = fw.kda_attention(cfg, w, x, kda_impl="recurrent")
    b = fw.kda_attention(cfg, w, x, kda_impl="chunked")
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_causal_conv(cfg):
    x = torch.randn(1, 10, 6)
    w = torch.randn(6, 1, 4)
    y = fw._causal_conv_silu(x, w)
    for t in range(10):
        acc = torch.zeros(6)
        for j in range(4):  # tap j sees x[t - (3 - j)]
            s = t - (3 - j)
            if s >= 0:
                acc += w[:, 0, j] * x[0, s]
        assert torch.allclose(y[0, t], torch.nn.functional.silu(acc), atol=1e-6)


def _mla_naive(cfg, w, x, keep=None):
    """MLA by an explicit loop over queries and heads."""
    B, T, _ = x.shape
    nh, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    rms = lambda a, wt: a / torch.sqrt((a * a).mean(-1, keepdim=True) + cfg.rms_norm_eps) * wt  # noqa: E731
    qr = rms(x @ w["self_attn.q_a_proj.weight"].T, w["self_attn.q_a_layernorm.weight"])
    q = (qr @ w["self_attn.q_b_proj.weight"].T).view(B, T, nh, dn + dr)
    ckv = x @ w["self_attn.kv_a_proj_with_mqa.weight"].T
    c = rms(ckv[..., :cfg.kv_lora_rank], w["self_attn.kv_a_layernorm.weight"])
    kpe = ckv[..., cfg.kv_lora_rank:]
    kv = (c @ w["self_attn.kv_b_proj.weight"].T).view(B, T, nh, dn + dv)
    gate = torch.sigmoid(x @ w["self_attn.g_proj.weight"].T)
    out = torch.zeros(B, T, nh * dv)
    for b in range(B):
        for s in range(T):
            for hh in range(nh):
                sc = []
                for t in range(s + 1):
                    kk = torch.cat([kv[b, t, hh, :dn], kpe[b, t]])
                    val = (q[b, s, hh] @ kk).item() / math.sqrt(dn + dr)
                    if keep is not None and not keep[b, s, t]:
                        val = -math.inf
                    sc.append(val)
                p = torch.softmax(torch.tensor(sc), 0)
                o = sum(p[t] * kv[b, t, hh, dn:] for t in range(s + 1))
                out[b, s, hh * dv:(hh + 1) * dv] = o
    return (out * gate) @ w["self_attn.o_proj.weight"].T


def test_mla_dense_vs_loop(cfg):
    import dataclasses
    c2 = dataclasses.replace(cfg, index_topk=None)
    w = {k: v for k, v in _rand_layer(cfg, 3).items() if "indexer" not in k}
    x = torch.randn(1, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(fw.mla_attention(c2, w, x), _mla_naive(c2, w, x), atol=5e-5)


def test_mla_dsa_vs_loop(cfg):
    w = _rand_layer(cfg, 3, seed=1)
    T = 20  # > index_topk = 8
    # its own generator: the global one's state depends on the tests run before. The tolerance is float32
    # summation order over O(1) outputs (60 seeded inputs: at most 1.8e-5 apart, one of them past the 1e-5 this had)
    x = torch.randn(1, T, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    qr = fw.rmsnorm(x @ w["self_attn.q_a_proj.weight"].T, w["self_attn.q_a_layernorm.weight"], cfg.rms_norm_eps)
    keep = fw.topk_mask(fw.indexer_scores(cfg, w, x, qr), cfg.index_topk)
    got = fw.mla_attention(cfg, w, x)
    assert torch.allclose(got, _mla_naive(cfg, w, x, keep), atol=5e-5)
    # the mask really removes something once T > topk
    import dataclasses
    dense = fw.mla_attention(dataclasses.replace(cfg, index_topk=None), w, x)
    assert not torch.allclose(got[:, cfg.index_topk:], dense[:, cfg.index_topk:], atol=1e-4)
    assert torch.allclose(got[:, :cfg.index_topk], dense[:, :cfg.index_topk], atol=1e-5)


def test_indexer_scores_and_topk_naive(cfg):
    w = _rand_layer(cfg, 5, seed=2)
    T = 14
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, T, cfg.hidden_size, generator=gen)
    qr = torch.randn(1, T, cfg.q_lora_rank, generator=gen)
    I = fw.indexer_scores(cfg, w, x, qr)
    ih, idd, dr = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim

    def rope(vec, pos):
        out = vec.clone()
        half = dr // 2
        for j in range(half):
            ang = pos * 10000.0 ** (-2 * j / dr)
            a, b = vec[j], vec[j + half]
            out[j] = a * math.cos(ang) - b * math.sin(ang)
            out[j + half] = a * math.sin(ang) + b * math.cos(ang)
        return out

    wq = (qr @ w["self_attn.indexer.wq_b.weight"].T).view(1, T, ih, idd)
    kraw = x @ w["self_attn.indexer.wk.weight"].T
    mu, var = kraw.mean(-1, keepdim=True), kraw.var(-1, unbiased=False, keepdim=True)
    kn = (kraw - mu) / torch.sqrt(var + 1e-6) * w["self_attn.indexer.k_norm.weight"] + w["self_attn.indexer.k_norm.bias"]
    hw = x @ w["self_attn.indexer.weights_proj.weight"].T
    for s in range(T):
        for t in range(s + 1):
            kt = rope(kn[0, t], t)
            tot = 0.0
            for hh in range(ih):
                qs = rope(wq[0, s, hh], s)
                tot += hw[0, s, hh] * ih ** -0.5 * torch.relu(qs @ kt) * idd ** -0.5
            assert abs(I[0, s, t].item() - float(tot)) < 1e-4
    keep = fw.topk_mask(I, 4)
    for s in range(T):
        kept = [t for t in range(T) if keep[0, s, t]]
        assert len(kept) == min(4, s + 1) and all(t <= s for t in kept)
        dropped = [I[0, s, t].item() for t in range(s + 1) if t not in kept]
        if dropped:  # ties may break either way; the kept ones are never worse
            assert min(I[0, s, t].item() for t in kept) >= max(dropped)


def test_router(cfg):
    g = torch.Generator().manual_seed(3)
    W = torch.randn(cfg.num_experts, cfg.hidden_size, generator=g) * 0.1
    bias = torch.randn(cfg.num_experts, generator=g)
    x = torch.randn(5, cfg.hidden_size, generator=g)
    idx, wts = fw.route(cfg, W, bias, x)
    for n in range(5):
        s = [1 / (1 + math.exp(-(x[n] @ W[e]).item())) for e in range(cfg.num_experts)]
        order = sorted(range(cfg.num_experts), key=lambda e: -(s[e] + bias[e].item()))[:cfg.num_experts_per_token]
        assert set(idx[n].tolist()) == set(order)
        tot = sum(s[e] for e in order)
        for e, wv in zip(idx[n].tolist(), wts[n].tolist()):
            assert abs(wv - s[e] / tot * cfg.routed_scaling_factor) < 1e-6


def test_moe_vs_naive_and_dense(cfg):
    w = _rand_layer(cfg, 1)
    x = torch.randn(1, 7, cfg.hidden_size)
    got = fw.moe(cfg, w, x)
    dense = fw.moe(cfg, w, x, dense=True)
    assert torch.allclose(got, dense, atol=1e-5)
    M = "block_sparse_moe."
    idx, wts = fw.route(cfg, w[M + "gate.weight"], w[M + "gate.e_score_correction_bias"], x[0])
    situ = lambda a, b: 4 * torch.tanh(a / 4) * torch.sigmoid(a) * 25 * torch.tanh(b / 25)  # noqa: E731
    for n in range(7):
        z = w[M + "routed_expert_down_proj.weight"] @ x[0, n]
        y = torch.zeros_like(z)
        for e, wv in zip(idx[n].tolist(), wts[n]):
            E = f"{M}experts.{e}."
            y += wv * (w[E + "w2.weight"] @ situ(w[E + "w1.weight"] @ z, w[E + "w3.weight"] @ z))
        y = y / torch.sqrt((y * y).mean() + cfg.rms_norm_eps) * w[M + "routed_expert_norm.weight"]
        out = w[M + "routed_expert_up_proj.weight"] @ y
        S = M + "shared_experts."
        out += w[S + "down_proj.weight"] @ situ(w[S + "gate_proj.weight"] @ x[0, n], w[S + "up_proj.weight"] @ x[0, n])
        assert torch.allclose(got[0, n], out, atol=1e-5)


def test_attn_res_mix():
    g = torch.Generator().manual_seed(4)
    H = 8
    blocks = [torch.randn(2, 3, H, generator=g) for _ in range(2)]
    p = torch.randn(2, 3, H, generator=g)
    proj, norm = torch.randn(1, H, generator=g), torch.randn(H, generator=g)
    got = fw.attn_res_mix(blocks, p, proj, norm)
    vals = blocks + [p]
    for b in range(2):
        for t in range(3):
            logits = []
            for v in vals:
                r = v[b, t] / torch.sqrt((v[b, t] ** 2).mean() + 1e-5)
                logits.append((r * norm * proj[0]).sum())
            a = torch.softmax(torch.stack(logits), 0)
            assert torch.allclose(got[b, t], sum(a[k] * vals[k][b, t] for k in range(3)), atol=1e-6)
    assert fw.attn_res_mix([], p, proj, norm) is p


def test_layer_state_blocks(cfg):
    """Block residual bookkeeping: a block is closed at every layer i with i % B == 0."""
    x = torch.randn(1, 5, cfg.hidden_size)
    st = fw.State(x, [])
    for i in range(cfg.num_hidden_layers):
        st = fw.layer_forward(cfg, i, _rand_layer(cfg, i, seed=i), st)
        assert len(st.blocks) == i // cfg.attn_res_block_size + 1
    assert torch.equal(st.blocks[0], x)


def test_situ():
    a, b = torch.randn(100), torch.randn(100) * 30
    ref = (4 * torch.tanh(a / 4) * torch.sigmoid(a)) * (25 * torch.tanh(b / 25))
    assert torch.allclose(fw.situ(a, b), ref)


def test_act_quant_int8_and_mxfp8():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, generator=g) * 3
    q = fw.quant_act_int8(x)
    s = x.abs().amax(-1, keepdim=True) / 127
    assert torch.allclose(q / s, torch.round(q / s), atol=1e-4)
    assert ((q - x).abs() <= s / 2 + 1e-6).all()
    m = fw.quant_act_mxfp8(x)
    for r in range(4):
        for blk in range(2):
            xb = x[r, blk * 32:(blk + 1) * 32]
            e = math.floor(math.log2(xb.abs().max().item())) - 8
            ref = (xb / 2.0 ** e).to(torch.float8_e4m3fn).float() * 2.0 ** e
            assert torch.equal(m[r, blk * 32:(blk + 1) * 32], ref)
    assert torch.equal(fw.quant_act_mxfp8(torch.zeros(2, 32)), torch.zeros(2, 32))


def test_unit_lower_solve_matches_torch():
    g = torch.Generator().manual_seed(7)
    for C in (64, 16, 12, 7):
        L = torch.randn(2, 3, C, C, generator=g).tril(-1) * 0.2
        R = torch.randn(2, 3, C, 5, generator=g)
        ref = torch.linalg.solve_triangular(L + torch.eye(C), R, upper=False, unitriangular=True)
        assert torch.allclose(kda.unit_lower_solve(L, R), ref, atol=1e-5)


def test_kda_chunked_is_differentiable():
    q, k, v, g, beta = _kda_inputs(B=1, T=40, h=2, dk=8, dv=8)
    for t in (q, k, v, g, beta):
        t.requires_grad_(True)
    o1, _ = kda.kda_recurrent(q, k, v, g, beta)
    grads1 = torch.autograd.grad(o1.square().sum(), (q, k, v, g, beta))
    o2, _ = kda.kda_chunked(q, k, v, g, beta, chunk_size=16)
    grads2 = torch.autograd.grad(o2.square().sum(), (q, k, v, g, beta))
    for a, b in zip(grads1, grads2):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3)


def test_kda_low_rank_output_gate_and_softplus_decay():
    """K3 without use_full_rank_gate names g_a_proj/g_b_proj; without gate_lower_bound the decay is
    FLA's softplus form. Both against the formulas written out."""
    import copy

    cfg_d = copy.deepcopy(preset_config("tiny"))
    lac = cfg_d["text_config"]["linear_attn_config"]
    lac["use_full_rank_gate"] = False
    del lac["gate_lower_bound"]
    spec = spec_from_config(cfg_d)
    c = spec.text
    names = spec.expected_tensors(with_vision=False)
    L = "language_model.model.layers.0.self_attn."
    assert names[L + "g_a_proj.weight"][0] == (c.kda_head_dim, c.hidden_size)
    assert names[L + "g_b_proj.weight"][0] == (c.kda_num_heads * c.kda_head_dim, c.kda_head_dim)
    assert L + "g_proj.weight" not in names
    assert spec.role(L + "g_b_proj.weight").role == "kda.gate_proj"
    g = torch.Generator().manual_seed(5)
    w = {n[len(L) - len("self_attn."):]: torch.randn(s, generator=g) * (s[-1] ** -0.5 if len(s) > 1 else 0.3)
         for n, (s, _) in names.items() if n.startswith(L)}
    h, d = c.kda_num_heads, c.kda_head_dim
    w["self_attn.A_log"] = w["self_attn.A_log"][:h]  # the official module's [h] (the release pads it)
    x = torch.randn(1, 9, c.hidden_size, generator=g)
    got = fw.kda_attention(c, w, x, kda_impl="recurrent")
    # the same layer written out with the full-rank path fed the product g_b @ g_a
    full = dict(w)
    full["self_attn.g_proj.weight"] = w["self_attn.g_b_proj.weight"] @ w["self_attn.g_a_proj.weight"]
    import dataclasses
    want = fw.kda_attention(dataclasses.replace(c, use_full_rank_gate=True), full, x, kda_impl="recurrent")
    assert torch.allclose(got, want, atol=1e-5)
    f = (x @ w["self_attn.f_a_proj.weight"].T @ w["self_attn.f_b_proj.weight"].T).view(1, 9, h, d)
    A = torch.exp(w["self_attn.A_log"][:h])
    z = f + w["self_attn.dt_bias"].view(h, d)
    softplus = torch.log1p(torch.exp(z))
    assert torch.allclose(fw.kda_decay(c, f, w["self_attn.A_log"], w["self_attn.dt_bias"].view(h, d)),
                          -A.view(h, 1) * softplus, atol=1e-6)
    lb = dataclasses.replace(c, gate_lower_bound=-5.0)
    assert torch.allclose(fw.kda_decay(lb, f, w["self_attn.A_log"], w["self_attn.dt_bias"].view(h, d)),
                          -5.0 * torch.sigmoid(A.view(h, 1) * z), atol=1e-6)
