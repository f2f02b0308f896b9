"""GPTQ's candidate grids beyond the codec's own, each judged per row on H before GPTQ runs.

int4 per channel: the codec's scale times clip ratios, and the two powers of two bracketing it
(``clip_ranked`` screens them cheaply and judges the finalists); MX: each block's exponent chosen by
its input-weighted error (``mx_grid_on_h``).  Grids are combined row by row (``pick_rows``).
"""

from __future__ import annotations

import numpy as np

from . import numerics as nm
from .base import Grid
from .gptq_judge import SCREEN_RANK, Judge, values_of


def grid_rows(g: Grid, rows: np.ndarray) -> Grid:
    """The grid of rows ``rows`` of ``g``."""
    return Grid(g.scale[rows], g.group, g.kind, g.qmin, g.qmax, None if g.scale_bytes is None else g.scale_bytes[rows])


def pick_rows(best: np.ndarray, grids: list) -> Grid:
    """The grid whose row n is ``grids[best[n]]``'s row n."""
    out = grids[0]
    for i in range(1, len(grids)):
        take = best == i
        if take.any():
            out = _merge_grids(out, grids[i], take)
    return out


def _merge_grids(a: Grid, b: Grid, take: np.ndarray) -> Grid:
    """Grid with rows of ``b`` where ``take`` and rows of ``a`` elsewhere (same kind and group)."""
    sb = None
    if a.scale_bytes is not None:
        sb = np.where(take[:, None], b.scale_bytes, a.scale_bytes)
    return Grid(np.where(take[:, None], b.scale, a.scale).astype(np.float32), a.group, a.kind, a.qmin, a.qmax, sb)


def clippable(g: Grid) -> bool:
    """int grids of at most 4 bits: int8's step is so fine that a clip judged before GPTQ can lose
    after it (tests/test_gptq.py shows a case), and it has little rounding error to trade. Per channel
    only: a per-group scale must stay a float16 value (vLLM-Ascend rounds weight_scale x
    weight_scale_second to float16 at load), and r x s is not one."""
    return g.kind == "int" and g.qmax - g.qmin < 16 and g.scale.shape[1] == 1


def _scaled(g: Grid, r: float) -> Grid:
    """``g`` with every scale times r (an int grid: codes still clip(rint(w / s), qmin, qmax))."""
    return Grid((g.scale * np.float32(r)).astype(np.float32), g.group, g.kind, g.qmin, g.qmax, g.scale_bytes)


def _pow2_bracket(g: Grid) -> list:
    """Two grids: per row, the largest power of two <= ``g``'s scale and the smallest one above it."""
    _, e = np.frexp(np.asarray(g.scale, np.float32))  # scale = m 2^e, m in [0.5, 1)
    return [Grid(np.ldexp(np.float32(1.0), e + d).astype(np.float32), g.group, g.kind, g.qmin, g.qmax, g.scale_bytes)
            for d in (-1, 0)]


def scale_candidates(g: Grid, ratios, pow2: bool) -> list:
    """The candidate grids beside ``g``: r x its scale per ratio, then (``pow2``) the power-of-two bracket."""
    return [_scaled(g, r) for r in ratios] + (_pow2_bracket(g) if pow2 else [])


def clip_before(w: np.ndarray, g: Grid, ratios, judge: Judge, known: list, finalists: int,
                 pow2: bool = False) -> Grid:
    """Per row, the best scale of ``clip_ranked`` (see there)."""
    return clip_ranked(w, g, ratios, judge, known, finalists, pow2, 1)[0]


def clip_ranked(w: np.ndarray, g: Grid, ratios, judge: Judge, known: list, finalists: int,
                pow2: bool = False, keep: int = 1) -> list:
    """Per row, the scale among ``g``'s, r x it (r in ``ratios``) and (``pow2``) the two powers of two
    bracketing it whose plain rounding has the smallest input-weighted error on H (ties keep the
    earlier, the unclipped first).

    With more clipped ratios than ``finalists``, every ratio is first scored on a cheap estimate
    (``Judge.screen``); per row the best-scored clipped ratio is judged beside the unclipped scale
    (or taken without a product where the screen puts it ahead by more than its inaccuracy and no
    other ratio comes close), and the next ones (up to ``finalists``) only on the rows where their score comes within the
    screen's own inaccuracy of the best (measured per row on the unclipped candidate, judged anyway:
    four times its relative error, plus 2%): about one float32 [N, K] x [K, K] product per finalist kept instead of
    one per ratio.  Appends (g, its plain codes, their error) to ``known`` (the guard's data-free
    codes, often the same).

    -> ``keep`` grids: the first holds each row's best scale, the next ones its runner-ups, ranked by their
    judged error where they were judged and by the screen's score elsewhere (for GPTQ to run on each, the row
    choosing after it)."""
    clipped = scale_candidates(g, ratios, pow2)

    def plain(grid, rows=slice(None)):  # per channel (clippable): scale [N, 1]
        c = w[rows] / grid.scale[rows]
        return np.clip(np.rint(c, out=c), grid.qmin, grid.qmax, out=c)

    codes0 = plain(g)
    values0 = values_of(codes0, g)
    err0 = judge.fast(values0)
    known.append((g, codes0.astype(np.int8), err0))
    grids, errs = [g], [err0]
    settled = np.zeros(len(w), dtype=bool)  # rows whose ratio the screen decides alone
    if len(clipped) <= finalists:
        grids += clipped
        errs += [judge.fast(values_of(plain(gr), gr)) for gr in clipped]
    else:
        G, r = judge.screen(SCREEN_RANK)

        from .gptq_kernels import plain_errors

        d = np.empty_like(w)

        def score(grid):  # |d G|^2 + sum_k d_k^2 r_k of the plain rounding on ``grid``
            diag = plain_errors(w, np.ascontiguousarray(grid.scale[:, 0]), np.float32(grid.qmin),
                                np.float32(grid.qmax), r, d)
            p = d @ G
            return (p * p).sum(axis=1, dtype=np.float64) + diag

        scores = np.stack([score(gr) for gr in clipped])
        # per row (so that rows stay independent problems): the screen's relative miss on the
        # unclipped candidate, four times, plus 2%
        unclipped = score(g)
        slack = np.minimum(1.0, 4.0 * np.abs(unclipped / np.maximum(err0, judge.floor + 1e-300) - 1) + 0.02)
        order = np.argsort(scores, axis=0, kind="stable")
        n = np.arange(len(w))
        best_score = scores[order[0], n]
        close = [scores[order[f], n] <= best_score * (1 + slack) for f in range(1, finalists)]
        # rows where the screen puts the best clipped ratio clearly ahead of the unclipped one, with no
        # other ratio close: that ratio, without a product
        settled = (best_score < unclipped * (1 - slack)) & ~np.any(close, axis=0)
        for f in range(finalists):
            rows = np.flatnonzero(~settled if f == 0 else close[f - 1])
            if f and rows.size == 0:
                break
            grid = pick_rows(order[f], clipped)
            e = np.full(len(w), np.inf)
            e[rows] = judge.fast(values_of(plain(grid, rows), grid_rows(grid, rows)), rows)
            grids.append(grid)
            errs.append(e)
    best, _ = judge.choose(errs, [lambda rows, gr=gr: values_of(plain(gr, rows), grid_rows(gr, rows)) for gr in grids])
    best[settled] = 1
    chosen = [pick_rows(best, grids)]
    if keep > 1:
        n = np.arange(len(w))
        cands = [g] + clipped  # each row's candidates by index: judged error, else screen score
        if len(grids) == len(cands):
            rank = np.stack(errs)
            first = best
        else:
            rank = np.concatenate([unclipped[None], scores])
            idx = np.concatenate([np.zeros((1, len(w)), np.int64), order[:len(grids) - 1] + 1])  # grids -> cands
            E = np.stack(errs)
            fin = np.isfinite(E)
            for i in range(len(grids)):
                rank[idx[i, fin[i]], n[fin[i]]] = E[i, fin[i]]
            first = idx[best, n]
        rank[first, n] = -np.inf
        ranked = np.argsort(rank, axis=0, kind="stable")
        chosen += [pick_rows(ranked[j], cands) for j in range(1, min(keep, len(cands)))]
    return chosen


def mx_grid_on_h(w: np.ndarray, elem: str, hessian: np.ndarray) -> Grid:
    """The MX grid whose per-block exponent (the OCP rule e0, or e0 + 1, as the data-free rule) is chosen
    by the block's input-weighted error of plain rounding, d_b H_bb d_b^T with H_bb the block's 32 x 32
    diagonal part of H (ties and all-zero blocks: the OCP rule)."""
    emax, round_fn, _ = nm.MX_ELEMENTS[elem]
    N, K = w.shape
    b = nm.mx_blocks(w)
    a = np.abs(b)
    amax = a.max(axis=2)
    nz = amax > 0
    E = np.where(nz, nm.floor_log2(np.where(nz, amax, 1.0).astype(np.float32)), 0)
    e0 = np.maximum(E - emax, nm.MX_EMIN)
    e1 = np.maximum(E - emax + 1, nm.MX_EMIN)
    nb = K // nm.BLOCK
    idx = np.arange(nb)
    Hb = np.asarray(hessian, np.float64).reshape(nb, nm.BLOCK, nb, nm.BLOCK)[idx, :, idx, :]  # [nb, 32, 32]
    errs = []
    for e in (e0, e1):
        y = a * nm.pow2_f32(-e)[..., None]
        _, v = round_fn(y)
        d = np.where(b < 0, -1.0, 1.0) * (y.astype(np.float64) - v) * nm.pow2_f32(e).astype(np.float64)[..., None]
        errs.append(np.einsum("nbi,bij,nbj->nb", d, Hb, d))
    use1 = nz & (e1 != e0) & (errs[1] < errs[0])
    e = np.where(use1, e1, e0)
    scale = np.where(nz, e + nm.E8M0_BIAS, nm.E8M0_ZERO_BLOCK).astype(np.uint8)
    return Grid(nm.e8m0_to_f32(scale), nm.BLOCK, elem, scale_bytes=scale)
