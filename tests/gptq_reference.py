"""A plain reference of the calibrated path, for tests/test_gptq.py: what ``gptq.gptq_quantize`` computes,
written for reading, in float64 wherever it can be, with every candidate judged by an exact float64
product (no screen, no float32 estimates, no error taken from GPTQ itself).

It is the algorithm of the implementation before the fast path (the factor from numpy's float64
inverse, GPTQ's inner loop the torch loop ``gptq_run(kernel=False)``, every clip ratio judged on plain
rounding before GPTQ, the per-row guard against the data-free codes)."""

from __future__ import annotations

import numpy as np
import torch

from kimi_quant.quant import gptq as G, gptq_clip as C, gptq_factor as F, gptq_judge as J


def reference_factor(H: np.ndarray, damp: float, act_order: bool):
    """(perm or None, U float32 torch): U the upper Cholesky factor of the permuted prepared H'^-1."""
    H = (np.asarray(H, np.float64) + np.asarray(H, np.float64).T) * 0.5
    dead = np.diagonal(H) <= 0
    H[dead, :] = 0
    H[:, dead] = 0
    H[dead, dead] = 1.0
    live = np.diagonal(H)[~dead]
    H[np.diag_indices_from(H)] += damp * (live.mean() if live.size else 1.0)
    perm = None
    if act_order:
        perm = np.argsort(-np.diagonal(H), kind="stable")
        H = H[perm][:, perm]
    U = np.linalg.cholesky(np.linalg.inv(H)).T  # H'^-1 = U^T U
    return (None if perm is None else torch.from_numpy(perm)), torch.from_numpy(U.astype(np.float32))


def reference_quantize(codec, w, matmul, H, cfg: G.GPTQConfig):
    w = np.ascontiguousarray(w, np.float32)
    perm, U = reference_factor(H, cfg.damp, cfg.act_order)

    def err(v):
        return J.weighted_error(w, v, H)

    free_grid, free_codes = codec.data_free_codes(w, matmul)
    grids = codec.gptq_grids(w, matmul, (free_grid, free_codes))
    ratios = [float(r) for r in cfg.clip_ratios if float(r) != 1.0]
    if ratios:
        out = []
        for g in grids:
            if not C.clippable(g):
                out.append(g)
                continue
            cands = [g, *(C._scaled(g, r) for r in ratios)]
            e = [err(J.values_of(np.clip(np.rint(w / c.scale), c.qmin, c.qmax), c)) for c in cands]
            out.append(C.pick_rows(np.argmin(e, axis=0), cands))
        grids = out
    cands = [(g, G.gptq_run(w, U, g, cfg, perm, kernel=False)[0]) for g in grids]
    if cfg.guard:
        cands.append((free_grid, free_codes))
    best = np.argmin([err(J.values_of(c, g)) for g, c in cands], axis=0)
    codes = np.choose(best[:, None], [c.astype(np.int16) for _, c in cands]) if len(cands) > 1 else cands[0][1]
    return codec.encode(codes, C.pick_rows(best, [g for g, _ in cands]), matmul)
