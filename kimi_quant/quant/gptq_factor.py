"""GPTQ's view of a Linear's input statistic H: prepared, permuted and inverted once per H.

``hessian_factor(H, K, damp, act_order, device)`` -> ``Factor``: dead inputs (H[k, k] = 0) made
identity, ``damp`` x the mean live diagonal added to the diagonal (more if the factorisation needs it),
columns in act-order, and the upper Cholesky factor U of the permuted H'^-1 (H'^-1 = U^T U) that
``gptq.gptq_run`` spreads each column's error with.  Up to FLOAT64_MAX_K inputs the work is float64
with a float32 result; above it float32 in place (one K x K matrix: a dense down projection's K ~ 34k
would need 9 GB in float64).  The last factor is kept with a copy of its H, for Linears fed the same
input (q/k/v, gate/up).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


#: K up to which the Hessian is prepared and factored in float64 (one K x K matrix: 512 MiB); above it
#: in float32, in place (the dense MLP's down projection, K ~ 34k: 4.6 GB for the one working matrix)
FLOAT64_MAX_K = 8192


#: rows of H per block when it is copied into the working matrix (bounds the float64 temporaries)
PREP_ROWS = 1024


@dataclass
class Factor:
    """GPTQ's view of a prepared Hessian H' (dead inputs made identity, ``shift`` added to the diagonal).

    perm:  act-order column order (torch int64 [K]) or None;
    U:     upper Cholesky factor of the permuted H'^-1 (H'^-1 = U^T U), float32 [K, K], contiguous;
    shift: the dampening added to the diagonal (damp x the mean live diagonal entry, plus any extra
           the factorisation needed), so that d H' d = d H d + shift |d|^2 for inputs that are live;
    dead:  whether some input was dead (then H' differs from H by more than the shift)."""

    perm: object
    U: object
    shift: float
    dead: bool


def _check_hessian(H: np.ndarray, K: int) -> None:
    if H.shape != (K, K):
        raise ValueError(f"hessian must be [K, K] = [{K}, {K}] for a weight with K={K} inputs, got {list(H.shape)}")
    for a in range(0, K, PREP_ROWS):  # by rows: no K x K boolean temporary
        if not np.isfinite(H[a:a + PREP_ROWS]).all():
            raise ValueError("hessian has non-finite entries")


def _prepared(H: np.ndarray, order: np.ndarray, dead: np.ndarray, shift: float, dtype):
    """R = the prepared H' in ``order`` (R[a, b] = H'[order[a], order[b]]) as a new torch matrix of
    ``dtype``: (H + H^T) / 2 in float64, dead rows/columns zero with 1 on the diagonal, + ``shift`` on
    the diagonal; above FLOAT64_MAX_K built a few rows at a time (float64 temporaries of ~128 MiB)."""
    import torch

    K = len(order)
    R = torch.empty((K, K), dtype=dtype)
    dead_o = dead[order]
    step = min(PREP_ROWS, max(16, (1 << 24) // K))
    if dtype == torch.float64 and H.dtype == np.float64:  # one pass over a matrix that fits
        from .gptq_kernels import permute_symmetric

        Rn = R.numpy()
        permute_symmetric(np.ascontiguousarray(H), np.ascontiguousarray(order, np.int64), Rn)
        if dead_o.any():
            Rn[:, dead_o] = 0
            Rn[dead_o] = 0
        i = np.arange(K)
        Rn[i, i] = np.where(dead_o, 1.0, Rn[i, i]) + shift
        return R
    for a in range(0, K, step):
        rows = order[a:a + step]
        n = len(rows)
        blk = np.take(np.take(H, rows, axis=0), order, axis=1).astype(np.float64, copy=False)
        blk = blk + np.take(np.take(H, rows, axis=1), order, axis=0).T
        blk *= 0.5
        blk[:, dead_o] = 0
        blk[dead_o[a:a + n]] = 0
        i = np.arange(n)
        blk[i, a + i] = np.where(dead_o[a:a + n], 1.0, blk[i, a + i]) + shift
        R[a:a + n] = torch.from_numpy(blk)
    return R


#: columns per panel of the in-place Cholesky (its temporaries: a few K x CHOLESKY_PANEL float32 blocks)
CHOLESKY_PANEL = 1024


def cholesky_in_place(A, panel: int = CHOLESKY_PANEL) -> int:
    """A <- L (lower Cholesky factor, zeros above the diagonal) for a symmetric float32 CPU matrix whose
    lower triangle is read, without a second K x K matrix (torch's ``cholesky_ex(out=A)`` still makes
    a full copy). Right-looking by panels: factor the diagonal block, solve the panel below it, update
    the lower trailing blocks with matrix products. Returns 0, or 1 + the first column that failed
    (not positive definite), as LAPACK's info."""
    import torch

    K = A.shape[0]
    rows = max(panel, (1 << 24) // max(1, panel))  # rows per solve / update step: temporaries of ~64 MiB
    for j in range(0, K, panel):
        e = min(j + panel, K)
        L11, info = torch.linalg.cholesky_ex(A[j:e, j:e])
        if int(info):
            return j + int(info)
        A[j:e, j:e] = L11
        for r in range(e, K, rows):  # panel below: X L11^T = A21
            r2 = min(r + rows, K)
            A[r:r2, j:e] = torch.linalg.solve_triangular(L11.T, A[r:r2, j:e], upper=True, left=False)
        for r in range(e, K, rows):  # lower trailing part: A22 -= A21 A21^T, rows r..r2, columns e..r2
            r2 = min(r + rows, K)
            A[r:r2, e:r2].addmm_(A[r:r2, j:e], A[e:r2, j:e].T, alpha=-1)
    for j in range(0, K, panel):  # zeros above the diagonal, as cholesky_ex leaves them
        e = min(j + panel, K)
        blk = A[j:e, j:e]
        blk.copy_(torch.tril(blk))
        A[j:e, e:].zero_()
    return 0


def _lower_inverse_in_place(L, leaf: int = 256):
    """L <- L^-1 for a lower-triangular float32 torch matrix (zeros above the diagonal), recursively:
    inv([[A, 0], [C, D]]) = [[A^-1, 0], [-D^-1 C A^-1, D^-1]], the products with the triangular
    inverses by ``_trmm`` (K^3 / 3 flops at matmul speed, where a triangular solve against the
    identity takes K^3 at a lower rate)."""
    import torch

    n = L.shape[0]
    if n <= leaf:
        L.copy_(torch.linalg.solve_triangular(L, torch.eye(n, dtype=L.dtype, device=L.device), upper=False))
        return
    h = n // 2
    _lower_inverse_in_place(L[:h, :h], leaf)
    _lower_inverse_in_place(L[h:, h:], leaf)
    C = L[h:, :h]
    step = max(1, (1 << 24) // h)  # rows, then columns, of C per product: temporaries of ~64 MiB
    for r in range(0, n - h, step):
        C[r:r + step] = _trmm(C[r:r + step], L[:h, :h], right=True)
    for c in range(0, h, step):
        C[:, c:c + step] = _trmm(L[h:, h:], C[:, c:c + step], right=False)
    C.neg_()


def _trmm(X, Y, right: bool, leaf: int = 512, out=None):
    """X @ Y with the lower-triangular factor (Y if ``right``, else X) split recursively, so that its
    zero upper part is never multiplied: half the flops of a full product.  The parts are written
    into ``out`` (a new matrix if None, never X or Y) where they belong."""
    import torch

    if out is None:
        out = torch.empty((X.shape[0], Y.shape[1]), dtype=X.dtype, device=X.device)
    T = Y if right else X
    n = T.shape[0]
    if n <= leaf:
        return torch.matmul(X, Y, out=out)
    h = n // 2
    if right:  # X [m, n] @ [[A, 0], [B, D]] = [X1 A + X2 B, X2 D]
        X1, X2 = X[:, :h], X[:, h:]
        _trmm(X1, T[:h, :h], True, leaf, out[:, :h]).addmm_(X2, T[h:, :h])
        _trmm(X2, T[h:, h:], True, leaf, out[:, h:])
        return out
    # [[A, 0], [B, D]] @ Y [n, m] = [A Y1, B Y1 + D Y2]
    Y1, Y2 = Y[:h], Y[h:]
    _trmm(T[h:, h:], Y2, False, leaf, out[h:]).addmm_(T[h:, :h], Y1)
    _trmm(T[:h, :h], Y1, False, leaf, out[:h])
    return out


def _factor_once(H: np.ndarray, K: int, damp: float, act_order: bool, dev) -> Factor:
    import torch

    diag = np.diagonal(H).astype(np.float64)
    dead = diag <= 0
    live = torch.from_numpy(diag)[torch.from_numpy(~dead)]
    mean = float(live.mean()) if live.numel() else 1.0
    shift = damp * mean
    pdiag = torch.from_numpy(np.where(dead, 1.0, diag) + shift)
    perm = torch.sort(pdiag, descending=True, stable=True).indices if act_order else None
    # J H' J = L L^T (J reverses the order) gives H'^-1 = U^T U with U = J L^-1 J upper triangular
    order = (perm if perm is not None else torch.arange(K)).flip(0).numpy()
    dtype = torch.float64 if K <= FLOAT64_MAX_K else torch.float32
    R = _prepared(H, order, dead, shift, dtype)
    pmean = float(torch.diagonal(R).mean())
    in_place = dtype == torch.float32 and dev.type == "cpu"
    extra = 0.0
    for _ in range(8):
        if extra and in_place:
            R = _prepared(H, order, dead, shift, dtype)  # the failed attempt overwrote it
            torch.diagonal(R).add_(extra)
        A = R if extra == 0.0 or in_place else R + torch.eye(K, dtype=dtype) * extra
        if in_place:
            L, info = A, cholesky_in_place(A)
        else:
            L, info = torch.linalg.cholesky_ex(A.to(dev))
        if int(info) == 0:
            L = _row_major_float32(L)
            _lower_inverse_in_place(L)
            if bool(torch.isfinite(L.sum())):  # an overflow anywhere makes the sum inf or nan
                if L.device.type == "cpu":
                    from .gptq_kernels import flip_in_place

                    flip_in_place(L.numpy())
                    U = L
                else:
                    U = L.flip((0, 1)).contiguous()
                return Factor(None if perm is None else perm.to(dev), U, shift + extra, bool(dead.any()))
        extra = pmean * (1e-3 if extra == 0.0 else 10.0 * extra / pmean)
    raise ValueError("hessian is not positive semi-definite (Cholesky failed even with extra dampening)")


def _row_major_float32(L):
    """The lower Cholesky factor as float32, row-major on the CPU (LAPACK returns it column-major; the
    flip and GPTQ's block slices read rows); other devices keep their layout."""
    import torch

    if L.device.type != "cpu":
        return L.to(torch.float32)
    if L.dtype == torch.float64 and L.mT.is_contiguous():
        from .gptq_kernels import lower_from_transposed

        out = torch.empty(L.shape, dtype=torch.float32)
        lower_from_transposed(L.mT.numpy(), out.numpy())
        return out
    return L.to(torch.float32, memory_format=torch.contiguous_format)


_LAST_FACTOR: list = []  # [(copy of H, damp, act_order, device, Factor)]: the last factor, for Linears sharing one H


#: largest K whose factor is kept after the call (with a copy of its H to recognise it: K^2 x 12 B,
#: 768 MiB at 8192); larger ones (a dense MLP's down projection, K ~ 34k) are not held past their call
KEEP_FACTOR_MAX_K = 8192


def hessian_factor(hessian, K: int, damp: float, act_order: bool, dev) -> Factor:
    """The prepared, permuted and inverted H (``Factor``).  The last one is kept with a copy of its H:
    Linears fed the same input (q/k/v, gate/up) come one after another with equal H (compared
    element for element; a copy, so that a caller refilling its array in place is never served a
    stale factor)."""
    H = np.asarray(hessian)
    _check_hessian(H, K)
    params = (damp, act_order, str(dev))
    if _LAST_FACTOR:
        kept, kept_params, factor = _LAST_FACTOR[0]
        if kept_params == params and kept.dtype == H.dtype and np.array_equal(kept, H):
            return factor
    _LAST_FACTOR.clear()
    factor = _factor_once(H, K, damp, act_order, dev)
    if K <= KEEP_FACTOR_MAX_K:
        _LAST_FACTOR.append((H.copy(), params, factor))
    return factor
