"""numba kernels of the calibrated path (``gptq``): the inside of one GPTQ lazy block and an in-place
flip, on the transposed weight (a block of columns is a block of contiguous rows).

They repeat the float32 operations of ``gptq.gptq_codes``'s torch loop (the reference) element for
element, without fastmath (no fused multiply-add, no reordering), so the codes come out identical.
Output rows are independent in GPTQ, so the work is tiled over them (``TILE``): a tile of the block
stays in the core's cache while every column of the block is processed.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .numerics import E2M1_VALUES, E4M3_MAX

KIND_INT, KIND_E2M1, KIND_E4M3 = 0, 1, 2
#: output rows per tile: B x TILE x 4 B (128 x 512: 256 KiB) of the block stays in L2
TILE = 512


@njit(cache=True)
def _e4m3_round(y):
    """float32 y in [0, 448] -> (float8_e4m3fn byte without sign, its value as float32): round half to
    even on 3 mantissa bits (multiples of 2^-9 below 2^-6), as torch's cast and ``numerics.e4m3_round``."""
    if y < np.float32(2.0**-6):
        m = np.rint(np.float64(y) * 512.0)
        return np.int16(m), np.float32(m * 2.0**-9)
    e = math.frexp(np.float64(y))[1] - 1  # floor(log2 y)
    q = math.ldexp(1.0, e - 3)
    r = min(np.rint(np.float64(y) / q) * q, E4M3_MAX)  # exact: y / q is a power-of-two scaling
    fr, e2 = math.frexp(r)
    b = ((e2 - 1 + 7) << 3) | (np.int64(fr * 16.0) - 8)
    return np.int16(b), np.float32(r)


@njit(cache=True)
def gptq_block(WT, ST, U1, kind, qmin, qmax, CT, ET, sq):
    """GPTQ over one lazy block. WT float32 [B, N]: the block's weights, already updated by earlier
    blocks (overwritten); ST float32 [B, N]: their scales; U1 float32 [B, B]: the block of the upper
    Cholesky factor of H^-1.  Column i (row i here): code c and value v on the grid (int: c = clip(rint(w
    / s), qmin, qmax), v = c s; e2m1 / e4m3: sign-magnitude MX codes of |w| / s, v = +-magnitude x s),
    e = (w - v) / U1[i, i], then w_j -= e U1[i, j] for the later columns j.  Writes the codes to CT
    (int16 [B, N]), the errors e to ET (float32 [B, N]) and adds e^2 to sq (float64 [N]): with
    H^-1 = U^T U, sum_k e_k^2 is the row's (w - q) H (w - q)^T on the H that U came from."""
    B, N = WT.shape
    e2m1 = E2M1_VALUES
    for t0 in range(0, N, TILE):
        t1 = min(t0 + TILE, N)
        T = t1 - t0
        sqt = sq[t0:t1]
        for i in range(B):  # slices of the tile: plain loops over 0..T that LLVM vectorizes
            wi = WT[i, t0:t1]
            si = ST[i, t0:t1]
            ci = CT[i, t0:t1]
            ei = ET[i, t0:t1]
            d = U1[i, i]
            if kind == KIND_INT:
                for n in range(T):
                    x = wi[n]
                    s = si[n]
                    c = min(max(np.float32(np.rint(np.float32(x / s))), qmin), qmax)
                    ci[n] = np.int16(c)
                    ei[n] = np.float32(np.float32(x - np.float32(c * s)) / d)
            elif kind == KIND_E2M1:
                for n in range(T):
                    x = wi[n]
                    s = si[n]
                    y = np.float32(abs(x) / s)
                    m = ((y > np.float32(0.25)) + (y >= np.float32(0.75)) + (y > np.float32(1.25))
                         + (y >= np.float32(1.75)) + (y > np.float32(2.5)) + (y >= np.float32(3.5))
                         + (y > np.float32(5.0)))
                    mag = e2m1[m]
                    neg = x < 0
                    ci[n] = np.int16(m | (8 if neg and m > 0 else 0))
                    v = np.float32((-mag if neg else mag) * s)
                    ei[n] = np.float32(np.float32(x - v) / d)
            else:
                for n in range(T):
                    x = wi[n]
                    s = si[n]
                    y = min(np.float32(abs(x) / s), np.float32(E4M3_MAX))
                    b, mag = _e4m3_round(y)
                    neg = x < 0
                    ci[n] = b | (128 if neg and b > 0 else 0)
                    v = np.float32((-mag if neg else mag) * s)
                    ei[n] = np.float32(np.float32(x - v) / d)
            for n in range(T):
                sqt[n] += np.float64(ei[n]) * np.float64(ei[n])
            for j in range(i + 1, B):
                u = U1[i, j]
                wj = WT[j, t0:t1]
                for n in range(T):
                    wj[n] = np.float32(wj[n] - np.float32(ei[n] * u))


@njit(cache=True)
def flip_in_place(A):
    """A[i, j] <- A[K-1-i, K-1-j] for a square matrix, without a second K x K buffer."""
    K = A.shape[0]
    for i in range((K + 1) // 2):
        r = K - 1 - i
        if i == r:
            for j in range(K // 2):
                a = A[i, j]
                A[i, j] = A[i, K - 1 - j]
                A[i, K - 1 - j] = a
            continue
        for j in range(K):
            a = A[i, j]
            A[i, j] = A[r, K - 1 - j]
            A[r, K - 1 - j] = a


@njit(cache=True)
def permute_symmetric(H, order, out):
    """out[a, b] = (H[o_a, o_b] + H[o_b, o_a]) / 2 in float64 (o = order), cast to out's dtype: the
    permuted symmetric part of H, gathered row by row and averaged in 64 x 64 tiles (cache friendly)."""
    K = len(order)
    for a in range(K):
        src = H[order[a]]
        dst = out[a]
        for b in range(K):
            dst[b] = src[order[b]]
    t = 64
    for a0 in range(0, K, t):
        for b0 in range(a0, K, t):
            for a in range(a0, min(a0 + t, K)):
                for b in range(max(b0, a), min(b0 + t, K)):
                    v = (np.float64(out[a, b]) + np.float64(out[b, a])) * 0.5
                    out[a, b] = v
                    out[b, a] = v


@njit(cache=True)
def gather_transposed(w, order, out):
    """out[k, n] = w[n, order[k]] (a transpose with the columns permuted): each row is permuted in
    cache, then 64 x 64 tiles are transposed."""
    N, K = w.shape
    t = 64
    tmp = np.empty((t, K), dtype=w.dtype)
    for n0 in range(0, N, t):
        n1 = min(n0 + t, N)
        for n in range(n0, n1):
            row = w[n]
            dst = tmp[n - n0]
            for k in range(K):
                dst[k] = row[order[k]]
        for k0 in range(0, K, t):
            for k in range(k0, min(k0 + t, K)):
                o = out[k]
                for n in range(n0, n1):
                    o[n] = tmp[n - n0, k]


@njit(cache=True)
def scatter_transposed(CT, order, out):
    """out[n, order[k]] = CT[k, n]: the inverse of ``gather_transposed`` (tiles transposed, then each
    row scattered in cache)."""
    K, N = CT.shape
    t = 64
    tmp = np.empty((t, K), dtype=CT.dtype)
    for n0 in range(0, N, t):
        n1 = min(n0 + t, N)
        for k0 in range(0, K, t):
            for k in range(k0, min(k0 + t, K)):
                c = CT[k]
                for n in range(n0, n1):
                    tmp[n - n0, k] = c[n]
        for n in range(n0, n1):
            src = tmp[n - n0]
            row = out[n]
            for k in range(K):
                row[order[k]] = src[k]


@njit(cache=True)
def plain_errors(w, scale, qmin, qmax, r, d_out):
    """Plain rounding of rows ``w`` [N, K] on per-row scales ``scale`` [N]: d_out = w - clip(rint(w / s),
    qmin, qmax) s (float32, as ``gptq_judge.values_of`` of those codes), and per row sum_k d_k^2 r_k in
    float64 (r float32 [K]), summed in k order -> [N].  Two passes per row: the rounding has no
    dependence between elements (it vectorizes), the float64 sum is a chain."""
    N, K = w.shape
    out = np.zeros(N)
    for n in range(N):
        s = scale[n]
        row = w[n]
        d = d_out[n]
        for k in range(K):
            x = row[k]
            c = min(max(np.float32(np.rint(np.float32(x / s))), qmin), qmax)
            d[k] = np.float32(x - np.float32(c * s))
        acc = 0.0
        for k in range(K):
            acc += np.float64(np.float32(d[k] * d[k])) * np.float64(r[k])
        out[n] = acc
    return out


@njit(cache=True)
def code_values(codes, table, scale, group, out):
    """out[n, k] = table[codes[n, k] & 0xFF] * scale[n, k // group] in float32: the weights that codes
    (of any integer or integral float dtype) stand for; ``table`` float32 [256] holds each code
    byte's element value (for int grids the signed byte)."""
    N, K = codes.shape
    for n in range(N):
        c = codes[n]
        o = out[n]
        sc = scale[n]
        for g0 in range(0, K, group):
            sg = sc[g0 // group]
            for k in range(g0, min(g0 + group, K)):
                o[k] = table[np.int64(c[k]) & 0xFF] * sg


@njit(cache=True)
def triangle_block(H, a, b, out):
    """out[i, j - a] (float32 [b, b - a]) = T[i, j] for i < b, a <= j < b: T the upper triangle of
    (H + H^T) / 2 (in float64) with its diagonal halved, zero below the diagonal; in 64 x 64 tiles
    (H read by rows and by columns stays in cache)."""
    t = 64
    for i0 in range(0, b, t):
        for j0 in range(a, b, t):
            for i in range(i0, min(i0 + t, b)):
                o = out[i]
                for j in range(j0, min(j0 + t, b)):
                    if i > j:
                        o[j - a] = 0.0
                    else:
                        v = (np.float64(H[i, j]) + np.float64(H[j, i])) * 0.5
                        if i == j:
                            v *= 0.5
                        o[j - a] = np.float32(v)


@njit(cache=True)
def lower_from_transposed(LT, out):
    """out (float32, row-major) = the lower triangle of LT^T (LT float64 [K, K], row-major: a column-major
    lower factor seen as its transpose), zeros above the diagonal; 64 x 64 tiles, each element cast once."""
    K = LT.shape[0]
    t = 64
    for i0 in range(0, K, t):
        for j0 in range(0, K, t):
            for i in range(i0, min(i0 + t, K)):
                o = out[i]
                for j in range(j0, min(j0 + t, K)):
                    o[j] = np.float32(LT[j, i]) if j <= i else np.float32(0.0)


@njit(cache=True)
def descend_int_codes(W, C, S, group, qmin, qmax, H, G, passes, gain_out):
    """Greedy coordinate descent on int codes, per row, lowering (w - c s) H (w - c s)^T with the row's
    scales fixed. W float32 [N, K]; C int16 [N, K] codes (updated in place); S float32 [N, K // group];
    H float64 [K, K] symmetric; G float64 [N, K] = (W - C S) H on entry (kept up to date).  Each pass visits
    k = 0..K-1 once: the best integer step for c_k alone is rint(g_k / (s H_kk)), clipped to [qmin, qmax];
    it is taken when its gain 2 s d g_k - (s d)^2 H_kk is positive, and g -= s d H[k, :].  Inputs with
    H_kk <= 0 are left alone.  A row stops after a pass without a step.  gain_out float64 [N]: each row's
    summed gain (the decrease of its error)."""
    N, K = W.shape
    for n in range(N):
        g = G[n]
        c = C[n]
        sc = S[n]
        total = 0.0
        for _ in range(passes):
            moved = False
            for k in range(K):
                h = H[k, k]
                if h <= 0.0:
                    continue
                s = np.float64(sc[k // group])
                ck = np.float64(c[k])
                cn = min(max(ck + np.rint(g[k] / (s * h)), np.float64(qmin)), np.float64(qmax))
                step = (cn - ck) * s
                if step == 0.0:
                    continue
                gain = 2.0 * step * g[k] - step * step * h
                if gain <= 0.0:
                    continue
                c[k] = np.int16(cn)
                total += gain
                moved = True
                hk = H[k]
                for j in range(K):
                    g[j] -= step * hk[j]
            if not moved:
                break
        gain_out[n] = total
