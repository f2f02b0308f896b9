"""Judging GPTQ's candidates: the input-weighted error of a quantized matrix, per row, and the choice.

``values_of(codes, grid)`` is what a candidate's codes stand for; ``Judge`` forms each row's error
``(w - v) H (w - v)^T`` (float32 products on H's upper triangle, float64 where candidates come close),
cheaper bounds and screens that settle most rows without a product, and the per-row argmin.
``weighted_error`` is the plain float64 reference.
"""

from __future__ import annotations

import numpy as np

from . import numerics as nm
from .base import Grid
from .gptq_factor import FLOAT64_MAX_K, Factor


def values_of(codes: np.ndarray, grid: Grid) -> np.ndarray:
    """float32 [N, K]: the weights the codes stand for (what ``dequantize`` of the encoded bytes gives)."""
    from .gptq_kernels import code_values

    N, K = codes.shape
    scale = np.ascontiguousarray(np.asarray(grid.scale, np.float32).reshape(N, -1))
    out = np.empty((N, K), dtype=np.float32)
    code_values(np.ascontiguousarray(codes), _value_table(grid.kind), scale, min(int(grid.group), K), out)
    return out


def _value_table(kind: str) -> np.ndarray:
    """float32 [256]: the element value of each code byte (int: the signed byte; e2m1: sign bit 3;
    e4m3: float8_e4m3fn)."""
    if kind not in _VALUE_TABLES:
        b = np.arange(256)
        if kind == "int":
            v = b.astype(np.uint8).view(np.int8).astype(np.float32)
        elif kind == "e2m1":
            v = nm.e2m1_to_f32((b & 15).astype(np.uint8))
        else:
            v = nm.e4m3_to_f32(b.astype(np.uint8))
        _VALUE_TABLES[kind] = np.ascontiguousarray(v, np.float32)
    return _VALUE_TABLES[kind]


_VALUE_TABLES: dict = {}


def weighted_error(w: np.ndarray, deq: np.ndarray, hessian: np.ndarray) -> np.ndarray:
    """Per row (w - deq) H (w - deq)^T in float64: the input-weighted error of a quantized matrix."""
    d = w.astype(np.float64) - deq.astype(np.float64)
    return ((d @ np.asarray(hessian, np.float64)) * d).sum(axis=1)


#: float32 judging: a row is re-judged in float64 when another candidate's float32 error lies within
#: this fraction of the best one (10x the largest float32 error measured on real Hessians; see Judge
#: and tests/test_gptq.py, which checks the margin)
JUDGE_RTOL = 1e-3


#: rows of the weight per product when errors are formed (bounds the [rows, K] temporaries)
JUDGE_ROWS = 2048


class Judge:
    """Per-row input-weighted errors ``(w - v) H (w - v)^T`` of candidate quantizations, and the per-row
    choice among them.

    The errors are formed with float32 products on the upper triangle of H (column blocks: ~0.55x the
    flops of a full product); every row where a second candidate comes within ``JUDGE_RTOL`` of the
    best (relative, plus a floor of 1e-9 of the row's diagonal energy sum_k w_k^2 H_kk for rows whose
    errors are ~0) is judged again with float64 products on just those rows, so each row's choice is
    the float64 argmin (ties: the earlier candidate).  H is read as given (float64 or float32, never
    copied whole): the float32 blocks of the triangle are kept for K <= FLOAT64_MAX_K, else formed
    per use."""

    def __init__(self, w: np.ndarray, hessian: np.ndarray, dev, shared: Judge | None = None):
        import torch

        self.dev = dev
        self.hessian = hessian
        K = hessian.shape[0]
        if shared is None:
            # column blocks of the triangle: 16 for a kept one, <= 1024 columns when formed per use
            nb = max(1, min(16, K // 224)) if K <= FLOAT64_MAX_K else -(-K // 1024)
            edges = [round(i * K / nb) for i in range(nb + 1)]
            self.blocks = list(zip(edges[:-1], edges[1:]))
            self._kept = [self._triangle_block(a, b) for a, b in self.blocks] if K <= FLOAT64_MAX_K else None
            self._low_rank = {}  # (rank, shift) -> pivoted Cholesky columns, shared by every chunk of rows
        else:
            self.blocks, self._kept, self._low_rank = shared.blocks, shared._kept, shared._low_rank
        self.w = w
        self.W32 = torch.from_numpy(w).to(dev)
        diag = np.clip(np.diagonal(hessian), 0, None).astype(np.float32)
        self.floor = 1e-9 * ((w * w) @ diag).astype(np.float64)
        self.refined = 0  # rows re-judged in float64 (diagnostic)

    def for_rows(self, w: np.ndarray) -> Judge:
        """A judge of the rows ``w`` of the same H, sharing this one's triangle blocks."""
        return Judge(w, self.hessian, self.dev, shared=self)

    def _triangle_block(self, a: int, b: int):
        """T[:b, a:b] as float32: T the upper triangle of (H + H^T) / 2 with its diagonal halved, so that
        d H d^T = 2 sum_{k <= j} d_k T_kj d_j (products with column blocks of T skip its zero part)."""
        import torch

        from .gptq_kernels import triangle_block

        T = np.empty((b, b - a), dtype=np.float32)
        triangle_block(self.hessian, a, b, T)
        return torch.from_numpy(T).to(self.dev)

    def fast(self, values: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """float32 estimate of each row's error (of rows ``rows`` only, whose values are ``values``
        [len(rows), K]), as float64 numpy."""
        import torch

        idx = np.arange(values.shape[0]) if rows is None else np.asarray(rows)
        out = torch.zeros(len(idx), dtype=torch.float64, device=self.dev)
        for r1 in range(0, len(idx), JUDGE_ROWS):
            sel = idx[r1:r1 + JUDGE_ROWS]
            part = slice(r1, r1 + len(sel))
            if rows is None:
                D = self.W32[part] - torch.from_numpy(np.ascontiguousarray(values[part], np.float32)).to(self.dev)
            else:
                D = torch.from_numpy(self.w[sel] - np.asarray(values[part], np.float32)).to(self.dev)
            for i, (a, b) in enumerate(self.blocks):  # sum_j (sum_{k <= j} D[:, k] T[k, j]) D[:, j]
                T = self._kept[i] if self._kept is not None else self._triangle_block(a, b)
                out[part] += ((D[:, :b] @ T) * D[:, a:b]).sum(dim=1, dtype=torch.float64)
        return out.mul_(2.0).cpu().numpy()

    def from_gptq(self, values: np.ndarray, sq: np.ndarray, factor: Factor) -> np.ndarray:
        """The error of a GPTQ result from its own sum of e^2 (``gptq_run``): d H d = d H' d - shift |d|^2
        when no input is dead; else (H' differs from H on the dead inputs) the float32 products."""
        import torch

        if factor.dead:
            return self.fast(values)
        d = torch.from_numpy(self.w) - torch.from_numpy(np.ascontiguousarray(values, np.float32))
        return sq - factor.shift * (d * d).sum(dim=1, dtype=torch.float64).numpy()

    def exact(self, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
        """float64 error of rows ``rows`` whose quantized values are ``values`` [len(rows), K]."""
        D = self.w[rows].astype(np.float64) - values.astype(np.float64)
        K = D.shape[1]
        if self.hessian.dtype == np.float64 and K <= FLOAT64_MAX_K:
            return ((D @ self.hessian) * D).sum(axis=1)
        out = np.zeros(len(rows))
        step = max(1, (1 << 24) // K)  # columns of H per product: float64 temporaries of ~128 MiB
        for a in range(0, K, step):
            out += ((D @ np.asarray(self.hessian[:, a:a + step], np.float64)) * D[:, a:a + step]).sum(axis=1)
        return out

    def choose(self, errs: list, values_of_rows: list):
        """``errs``: float32 estimates [N] per candidate; ``values_of_rows[c](rows)`` -> candidate c's values
        of those rows.  -> (index of the chosen candidate per row, its error)."""
        E = np.stack(errs)
        best = E.argmin(axis=0)  # first minimum: the earlier candidate on ties
        rows = np.arange(E.shape[1])
        emin = E[best, rows]
        if len(errs) > 1:
            slack = JUDGE_RTOL * (np.abs(emin) + self.floor)
            near = np.flatnonzero(((E - emin[None, :]) <= slack[None, :]).sum(axis=0) > 1)
            if near.size:
                self.refined += near.size
                E64 = np.stack([self.exact(near, f(near)) for f in values_of_rows])
                best[near] = E64.argmin(axis=0)
                emin[near] = E64[best[near], np.arange(near.size)]
        return best, emin

    def screen(self, rank: int):
        """A cheap estimate of (w - v) H (w - v)^T for many candidates: (G [K, m], r [K]) with H ~ G G^T +
        diag(r), G the first m columns of H's pivoted Cholesky (largest remaining diagonal first) and r
        the remaining diagonal: the estimate |d G|^2 + sum_k d_k^2 r_k is exact on the m pivots' span and
        counts the rest by its diagonal (O(N K m) per candidate)."""
        G, r = self._pivoted_cholesky(rank, 0.0)
        return G.astype(np.float32), r.astype(np.float32)

    def _pivoted_cholesky(self, rank: int, shift: float):
        """(G float64 [K, m], r float64 [K]): the first m <= rank columns of the pivoted Cholesky of
        (H + H^T) / 2 + shift I and its remaining diagonal (kept per (rank, shift), shared by the chunks)."""
        key = (rank, shift)
        if key not in self._low_rank:
            H = self.hessian
            K = H.shape[0]
            m = min(rank, K)
            G = np.zeros((K, m))
            r = np.diagonal(H).astype(np.float64) + shift
            for j in range(m):
                p = int(np.argmax(r))
                if r[p] <= 0:
                    G = G[:, :j]
                    break
                col = 0.5 * (H[:, p].astype(np.float64) + H[p, :].astype(np.float64))
                col[p] += shift
                g = (col - G[:, :j] @ G[p, :j]) / np.sqrt(r[p])
                G[:, j] = g
                r = np.maximum(r - g * g, 0.0)
            self._low_rank[key] = (G, r)
        return self._low_rank[key]

    def fast_unless_beaten(self, values: np.ndarray, rival: np.ndarray, factor: Factor) -> np.ndarray:
        """``fast``'s estimate of each row's error where it may come near ``rival`` (another candidate's
        per-row errors, from ``fast`` or ``from_gptq``); +inf on rows where a lower bound of the exact
        error already exceeds rival by more than BOUND_MARGIN (plus the floor): the choice there is the
        same, without a product.  Bound: H + s I = G G^T + S with S positive semi-definite (G: pivoted
        Cholesky columns, s: the factor's shift, with which H's Cholesky succeeded), so
        d H d >= |d G|^2 - s |d|^2, in float64.  With dead inputs (H' is not H + s I) every row is judged."""
        if factor.dead:
            return self.fast(values)
        G, _ = self._pivoted_cholesky(SCREEN_RANK, float(factor.shift))
        n = len(self.w)
        bound = np.empty(n)
        for r1 in range(0, n, BOUND_ROWS):  # row blocks: float64 temporaries that stay in cache
            D = self.w[r1:r1 + BOUND_ROWS].astype(np.float64) - np.asarray(values[r1:r1 + BOUND_ROWS], np.float64)
            P = D @ G
            bound[r1:r1 + len(D)] = np.einsum("nm,nm->n", P, P) - factor.shift * np.einsum("nk,nk->n", D, D)
        judge = np.flatnonzero(~(bound * (1 - BOUND_MARGIN) > rival + self.floor))
        out = np.full(n, np.inf)
        if judge.size:
            out[judge] = self.fast(np.asarray(values)[judge], judge)
        return out


#: rows per block of the lower bound's float64 temporaries
BOUND_ROWS = 256


#: relative margin by which a lower bound must exceed a rival's error for a candidate to be dropped
#: unjudged (10x JUDGE_RTOL: such a row would never have been re-judged in float64)
BOUND_MARGIN = 1e-2


#: columns of the pivoted Cholesky screen of the clip search (``Judge.screen``)
SCREEN_RANK = 32
