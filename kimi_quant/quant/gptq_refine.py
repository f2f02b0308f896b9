"""Refinement of GPTQ's int codes by coordinate descent on the input-weighted error.

GPTQ rounds each column once, in order, and never revisits it.  Given its codes and the row scales, a few
greedy passes over the codes (``gptq_kernels.descend_int_codes``: per row, each code moved to its best
integer value with the others fixed, when that lowers the error) lower d H' d further, where
d = w - c s and H' is GPTQ's own objective (H with the factor's shift on the live inputs' diagonal).
The scales are kept (they hold power-of-two rows on the MXFP4 grid exactly).

Cost: one float32 [N, K] x [K, K] product for the starting gradient, then O(K) per code visited and per
step taken (the gradient's update): ~one product's worth when a few per cent of the codes move.
"""

from __future__ import annotations

import numpy as np

from .base import Grid
from .gptq_judge import values_of


def objective(hessian: np.ndarray, shift: float) -> np.ndarray:
    """float64 [K, K]: (H + H^T) / 2 plus ``shift`` on the diagonal of the live inputs (H_kk > 0); the
    dead ones' rows and columns stay zero, so the descent leaves their codes alone."""
    H = np.asarray(hessian, np.float64)
    Hs = (H + H.T) * 0.5
    live = np.diagonal(Hs) > 0
    Hs[np.diag_indices_from(Hs)] += np.where(live, shift, 0.0)
    return Hs


def descend(w: np.ndarray, codes: np.ndarray, grid: Grid, Hs: np.ndarray, passes: int):
    """Codes of an int grid after ``passes`` passes of coordinate descent on (w - v) Hs (w - v)^T per row
    (``Hs`` from ``objective``) -> (new codes int16 [N, K], each row's decrease of that error, float64 [N]).
    Every step taken lowers the row's error as computed from its gradient; the gradient starts from a
    float32 product, so the decrease is exact up to float32 rounding of that start."""
    import torch

    from .gptq_kernels import descend_int_codes

    if grid.kind != "int":
        raise ValueError(f"coordinate descent refines int grids only, got {grid.kind}")
    w = np.ascontiguousarray(w, np.float32)
    N, K = w.shape
    D = torch.from_numpy(w - values_of(codes, grid))
    G = (D @ torch.from_numpy(Hs.astype(np.float32))).double().numpy()
    out = np.ascontiguousarray(codes, np.int16).copy()
    scale = np.ascontiguousarray(np.asarray(grid.scale, np.float32).reshape(N, -1))
    gain = np.zeros(N)
    descend_int_codes(w, out, scale, min(int(grid.group), K), np.float32(grid.qmin), np.float32(grid.qmax),
                      np.ascontiguousarray(Hs), G, int(passes), gain)
    return out, gain
