"""Plain numpy reference numerics for every codec: the definition the fast kernels must match bit for bit.

Everything here is vectorised numpy and meant to be read.  Conventions shared by all schemes:

* Input ``w`` is float32 ``[N, K]`` (in the converter: exact widenings of bfloat16).  Non-finite
  input raises :class:`NonFiniteWeight` (a ``ValueError``).
* "round" is IEEE round-half-to-even (``np.rint``); divisions ``w / s`` are float32 divisions.
* Floating-point sums whose rounding could depend on order are either exact by construction
  (integer-valued float64 terms) or accumulated in a fixed sequential order that the kernels copy.

Schemes
-------
W8A8_DYNAMIC  s = float32(amax / 127); q = clip(rint(w / s), -127, 127).
W4A8_DYNAMIC  int4 per row: best of a scale grid below absmax, then least-squares refit (``int4_search_scale``).
W4A8_MXFP     E2M1 + E8M0 per 32 along K, exponent chosen from {OCP rule e0, e0 + 1} by block SSE.
W8A8_MXFP8    E4M3 + E8M0 per 32 along K, exponent chosen likewise from {OCP rule, OCP rule + 1}.

All-zero rows/blocks: int scales are 1.0 (never 0 or NaN); MX scale byte is 127 (2^0); codes are 0. A row
so small that its int scale underflows to 0 (only F32 weights ~1e-45 can be) counts as all-zero.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32

#: W4A8_DYNAMIC scale grid, as fractions of the absmax scale amax / 7 (first entry must be 1).
#: Five points (was linspace(1, 0.25, 10)): the refit polishes the winner, so the coarser grid costs
#: ~0.5-1% of squared error (scripts/bench_codecs.py) for half the grid passes.
INT4_GRID = np.array([1.0, 0.8, 0.65, 0.5, 0.35], dtype=np.float32)
#: least-squares refit iterations for W4A8_DYNAMIC (early exit when the scale stops changing or
#: the error stops decreasing), and the over-relaxation of each refit step (s' = s + omega (ls - s)).
#: The plain step (omega 1) creeps: successive scales move 0.3-0.8% each, all the same way, so 6
#: refits were needed.  omega = 2.5 with 3 refits (half the passes over the row) ends with a lower
#: squared error (scripts/bench_codecs.py: gauss 0.4905 -> 0.4892, t4 0.2878 -> 0.2863, t2.5
#: 0.5331 -> 0.5323 of the absmax rule's); every accepted step still lowers the row's error.
INT4_MAX_ITERS = 3
INT4_REFIT_OMEGA = 2.5
#: fixed-point precision (bits below the row's top bit) of the exact ``sum(w*q)`` accumulator.
#: 24 bits = two 12-bit limbs, which lets the kernel sum exactly in float32 lanes (chunks of
#: INT4_CHUNK elements: |limb * q| < 2^15, 512 of them < 2^24).  Only |w| below ~2^-16 amax lose
#: bits, and those quantize to 0 at every candidate scale.
INT4_FIX_BITS = 24
INT4_LIMB_BITS = 12
INT4_CHUNK = 512
#: the kernel's cheaper one-limb pass: wm = trunc(w 2^(INT4_M_BITS - e)) (|wm| < 2^14, 128 products
#: < 2^24), used for a candidate scale only when every w it drops bits of quantizes to 0 there, so
#: sum(wf q) = 2^10 sum(wm q) exactly (the numbers, and so the result, are the same as here)
INT4_M_BITS = 14
INT4_M_CHUNK = 128
#: largest K for which the int4 accumulator is provably exact (see ``_int4_fixed_point``)
INT4_MAX_K = 1 << 17

#: E2M1 magnitude of code 0..7
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
#: a magnitude y gets code c >= i+1 iff y > T[i] (strict) or y >= T[i] (non-strict); the pattern
#: implements round-half-to-even on the E2M1 grid (ties go to the code with an even mantissa bit).
E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_ZERO_BLOCK = 127  # scale byte written for an all-zero block (2^0)
MX_EMIN = -127  # smallest E8M0 exponent used (byte 0)


class NonFiniteWeight(ValueError):
    """The weight contains NaN or +-Inf (row/column of the first one found)."""

    def __init__(self, row: int, col: int):
        super().__init__(f"weight has a non-finite value (NaN or Inf) at row {row}, column {col}")
        self.row, self.col = row, col


def check_finite(w: np.ndarray) -> None:
    if not np.isfinite(w).all():
        r, c = np.argwhere(~np.isfinite(w))[0]
        raise NonFiniteWeight(int(r), int(c))


def floor_log2(x: np.ndarray) -> np.ndarray:
    """floor(log2(x)) for positive float32 x (subnormals included), exactly, as int32."""
    return (np.frexp(x)[1] - 1).astype(np.int32)


# --------------------------------------------------------------------------------------------------
# W8A8_DYNAMIC


def int8_scale(amax: np.ndarray) -> np.ndarray:
    """float32 scale per row: amax / 127 (float32 division), 1.0 for all-zero rows."""
    s = amax.astype(np.float32) / np.float32(127.0)
    return np.where(s > 0, s, np.float32(1.0)).astype(np.float32)  # also rows whose amax / 127 underflows (F32 ~1e-45)


def int8_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """-> (q int8 [N, K] in [-127, 127], s float32 [N])."""
    check_finite(w)
    s = int8_scale(np.abs(w).max(axis=1))
    q = np.clip(np.rint(w / s[:, None]), -127, 127).astype(np.int8)
    return q, s


# --------------------------------------------------------------------------------------------------
# W4A8_DYNAMIC


def int4_codes(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """q = clip(rint(w / s), -8, 7) as float32 (w float32 [N, K], s float32 [N]): the absmax rule's codes."""
    return np.clip(np.rint(w / s[:, None]), np.float32(-8.0), np.float32(7.0))


def int4_reciprocal(s: np.ndarray) -> np.ndarray:
    """float32(1 / s) (float32 division); +inf where it overflows (s below ~2^-128)."""
    with np.errstate(divide="ignore", over="ignore"):
        return (np.float32(1.0) / s.astype(np.float32)).astype(np.float32)


def int4_codes_by(w: np.ndarray, s: np.ndarray, by_div: np.ndarray) -> np.ndarray:
    """Codes of candidate scale s per row: clip(rint(w * float32(1/s)), -8, 7) (a float32 multiply,
    much cheaper than a division in the kernel), or clip(rint(w / s), -8, 7) where ``by_div``.

    The absmax candidate s0 is always evaluated by division (its codes are exactly the naive rule's,
    which keeps the "never worse than absmax round-to-nearest" guarantee exact), and so is any
    candidate whose reciprocal overflows float32 (its products would be inf/NaN).
    """
    r = int4_reciprocal(s)
    with np.errstate(invalid="ignore", over="ignore"):
        qm = np.clip(np.rint(w * np.where(by_div, np.float32(1.0), r)[:, None]), np.float32(-8.0), np.float32(7.0))
    return np.where(by_div[:, None], int4_codes(w, s), qm)


def _int4_fixed_point(w: np.ndarray, amax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fixed-point copy of w used for the exact accumulator of sum(w*q).

    wf = trunc(w * 2^k) with k = INT4_FIX_BITS - (exponent of amax), so |wf| < 2^24.  Then
    |wf*q| < 2^27 and a row sum of K < 2^17 terms stays below 2^44: every partial sum is an exact
    float64 integer, so the sum does not depend on summation order (the kernel splits wf into two
    12-bit limbs and sums them exactly in float32 chunks).  Only values below 2^-24 * amax
    lose bits (bf16 values below ~2^-16 * amax), and those quantize to 0 at any sane scale.
    """
    e = np.frexp(amax)[1].astype(np.int64)  # amax < 2^e
    k = np.where(amax > 0, INT4_FIX_BITS - e, 0)
    wf = np.trunc(w.astype(np.float64) * np.ldexp(1.0, k)[:, None])
    return wf, k


def int4_stats(w, wf, k, s, by_div):
    """(sum(w q), sum(q q)) per row for scale s (codes per ``int4_codes_by``), in float64.

    sum(w q) is 2^-k * sum(wf q), an exact float64 integer sum (see ``_int4_fixed_point``)
    scaled exactly by a power of two; sum(q q) is an exact integer.
    """
    q = int4_codes_by(w, s, by_div).astype(np.float64)
    return np.ldexp((wf * q).sum(axis=1), -k), (q * q).sum(axis=1)


def int4_objective(s, sxq, sqq):
    """SSE(s) - sum(w^2) = s^2 sum(q^2) - 2 s sum(w q), in float64, evaluated left to right."""
    s = s.astype(np.float64)
    return s * s * sqq - 2.0 * s * sxq


def int4_search_scale(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row int4 scale: the best of a small grid below absmax, then a least-squares refit.

    Returns (s float32 [N], by_div bool [N]): the scale, and whether its codes are computed by
    division (see ``int4_codes_by``; the final codes must be computed the same way).

    1. Grid: s_i = float32(s0 * INT4_GRID[i]) with s0 = float32(amax / 7) and INT4_GRID[0] = 1,
       so the absmax round-to-nearest scale (evaluated by division) is always a candidate; keep the
       first one with the smallest squared error (ties keep the earlier, larger scale).
    2. Refit ("ssz"-style, per row, over-relaxed): q = codes(s); ls = sum(w q) / sum(q q);
       s' = float32(s + INT4_REFIT_OMEGA * (ls - s)) (float64 arithmetic, in that order).
       Stop when s' == s, or when s' does not strictly lower the row's squared error (s is kept),
       after at most INT4_MAX_ITERS refits.
    Candidates other than s0 use codes rint(w * float32(1/s)) (``int4_codes_by``).  Every accepted
    step lowers the squared error of the codes actually written, so the result is never worse than
    absmax round-to-nearest. The error is compared as s^2 sum(q^2) - 2 s sum(w q) (the row's
    sum(w^2) is common to all candidates).  All-zero rows get s = 1.0.
    """
    amax = np.abs(w).max(axis=1)
    s0 = (amax / np.float32(7.0)).astype(np.float32)
    nz = s0 > 0  # a row whose amax / 7 underflows (F32 weights ~1e-45) is quantized as an all-zero row
    s0 = np.where(nz, s0, np.float32(1.0)).astype(np.float32)
    wf, k = _int4_fixed_point(w, amax)
    s, best_e, sxq, sqq, div = None, None, None, None, None
    for f in INT4_GRID:
        s_try = (s0 * f).astype(np.float32)
        div_t = np.full(s_try.shape, s is None) | ~np.isfinite(int4_reciprocal(s_try))
        sxq_t, sqq_t = int4_stats(w, wf, k, s_try, div_t)
        e_t = int4_objective(s_try, sxq_t, sqq_t)
        if s is None:
            s, best_e, sxq, sqq, div = s_try, e_t, sxq_t, sqq_t, div_t
            continue
        better = nz & (e_t < best_e)
        s = np.where(better, s_try, s)
        sxq = np.where(better, sxq_t, sxq)
        sqq = np.where(better, sqq_t, sqq)
        div = np.where(better, div_t, div)
        best_e = np.where(better, e_t, best_e)
    active = nz.copy()
    for _ in range(INT4_MAX_ITERS):
        with np.errstate(divide="ignore", invalid="ignore"):
            s_new = (s + INT4_REFIT_OMEGA * (sxq / sqq - s)).astype(np.float32)
        active &= (sqq > 0) & (s_new > 0) & (s_new != s)
        if not active.any():
            break
        s_try = np.where(active, s_new, s)
        div_t = np.where(active, ~np.isfinite(int4_reciprocal(s_try)), div)
        sxq_new, sqq_new = int4_stats(w, wf, k, s_try, div_t)
        e_new = int4_objective(s_try, sxq_new, sqq_new)
        active &= e_new < best_e
        s = np.where(active, s_try, s)
        sxq = np.where(active, sxq_new, sxq)
        sqq = np.where(active, sqq_new, sqq)
        div = np.where(active, div_t, div)
        best_e = np.where(active, e_new, best_e)
    return s, div


def int4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """-> (q int8 [N, K] in [-8, 7], s float32 [N])."""
    check_finite(w)
    s, by_div = int4_search_scale(w)
    return int4_codes_by(w, s, by_div).astype(np.int8), s


def int4_absmax_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The naive rule (absmax / 7, round to nearest): the quality baseline."""
    s = (np.abs(w).max(axis=1) / np.float32(7.0)).astype(np.float32)
    s = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)
    return int4_codes(w, s).astype(np.int8), s


def pack_int4_along_n(q: np.ndarray) -> np.ndarray:
    """int4 codes [N, K] -> int8 [N/2, K]: byte[j,k] = (q[2j,k] & 0xF) | (q[2j+1,k] << 4)."""
    u = q.astype(np.uint8) & 0xF
    return (u[0::2] | (u[1::2] << 4)).view(np.int8)


def unpack_int4_along_n(b: np.ndarray) -> np.ndarray:
    """Inverse of pack_int4_along_n: int8 [N/2, K] -> int8 codes [N, K] (sign-extended nibbles)."""
    b = b.view(np.int8)
    lo = (b << 4) >> 4  # arithmetic shift sign-extends the low nibble
    hi = b >> 4
    q = np.empty((b.shape[0] * 2, b.shape[1]), dtype=np.int8)
    q[0::2], q[1::2] = lo, hi
    return q


def int4_scale_bias(q: np.ndarray, s: np.ndarray, matmul: str | None) -> np.ndarray:
    """8 * sum_k q[n,k] * s[n]: [N, 1] (gate/up) or [N, 16] over 16 contiguous K chunks (down).

    The integer sum times s is exact in float64 and rounded once to float32 (it overflows to +-inf
    only for weights near the float32 range, |w| > ~1e33, which real checkpoints never hold).
    """
    N, K = q.shape
    chunks = 16 if matmul == "down" else 1
    qsum = q.reshape(N, chunks, K // chunks).astype(np.int64).sum(axis=2).astype(np.float64)
    with np.errstate(over="ignore"):
        return (8.0 * qsum * s.astype(np.float64)[:, None]).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# MX: shared helpers


def mx_blocks(w: np.ndarray) -> np.ndarray:
    N, K = w.shape
    return w.reshape(N, K // BLOCK, BLOCK)


def pow2_f32(e: np.ndarray) -> np.ndarray:
    """2^e as float32 for integer e in [-126, 127] (exact)."""
    return np.ldexp(np.float32(1.0), e.astype(np.int32)).astype(np.float32)


def block_sse_tree(d: np.ndarray) -> np.ndarray:
    """sum of d^2 over the last axis (32) in float64, in a fixed halving order.

    d^2 (float64) is summed as s[j] + s[j + 16], then [j] + [j + 8], ... down to one value: the
    kernels repeat exactly these additions, so the rounding is identical (and vectorisable).
    """
    d = d.astype(np.float64)
    s = d * d
    while s.shape[-1] > 1:
        h = s.shape[-1] // 2
        s = s[..., :h] + s[..., h:]
    return s[..., 0]


def mx_quantize_blocks(w: np.ndarray, emax_elem: int, round_fn):
    """Shared MX scale choice. round_fn(y >= 0 float32) -> (code, value float32) on the element grid.

    Per block: E = floor(log2(amax)); candidates e0 = max(E - emax_elem, -127) (the OCP rule) and
    e1 = max(E - emax_elem + 1, -127); elements y = |x| * 2^-e are rounded with round_fn; the block
    keeps e1 only if its squared error 4^e1 * sum(d1^2) is strictly below 4^e0 * sum(d0^2).
    Returns (magnitude codes [N, K/32, 32], sign mask, scale bytes uint8 [N, K/32]).
    """
    check_finite(w)
    b = mx_blocks(w)
    a = np.abs(b)
    amax = a.max(axis=2)
    nz = amax > 0
    E = np.where(nz, floor_log2(np.where(nz, amax, 1.0).astype(np.float32)), 0)
    e0 = np.maximum(E - emax_elem, MX_EMIN)
    e1 = np.maximum(E - emax_elem + 1, MX_EMIN)
    y0 = a * pow2_f32(-e0)[..., None]  # exact: power-of-two scaling of bf16 values
    y1 = a * pow2_f32(-e1)[..., None]
    c0, v0 = round_fn(y0)
    c1, v1 = round_fn(y1)
    sse0 = block_sse_tree(y0 - v0)  # y - v is exact in float32 (grid points near y)
    sse1 = block_sse_tree(y1 - v1)
    use1 = nz & (e1 != e0) & (4.0 * sse1 < sse0)
    e = np.where(use1, e1, e0)
    code = np.where(use1[..., None], c1, c0)
    scale = np.where(nz, e + E8M0_BIAS, E8M0_ZERO_BLOCK).astype(np.uint8)
    return code, b < 0, scale


def mx_ocp_scale(w: np.ndarray, emax_elem: int) -> np.ndarray:
    """The plain OCP rule's scale bytes (quality baseline)."""
    amax = np.abs(mx_blocks(w)).max(axis=2)
    nz = amax > 0
    E = np.where(nz, floor_log2(np.where(nz, amax, 1.0).astype(np.float32)), 0)
    return np.where(nz, np.maximum(E - emax_elem, MX_EMIN) + E8M0_BIAS, E8M0_ZERO_BLOCK).astype(np.uint8)


def e8m0_to_f32(scale: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float32 2^(byte-127) (byte 0 -> 2^-127, a float32 subnormal; 255 -> NaN)."""
    out = np.ldexp(np.float32(1.0), scale.astype(np.int32) - E8M0_BIAS).astype(np.float32)
    return np.where(scale == 255, np.float32(np.nan), out)


# --------------------------------------------------------------------------------------------------
# E2M1 (W4A8_MXFP)


def e2m1_round(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round magnitudes y >= 0 to the E2M1 grid (half to even, saturating at 6) -> (code 0..7 uint8, value)."""
    code = np.zeros(y.shape, dtype=np.uint8)
    for t, inclusive in E2M1_THRESHOLDS:
        code += (y >= t) if inclusive else (y > t)
    return code, E2M1_VALUES[code]


def pack_nibbles_along_k(code: np.ndarray) -> np.ndarray:
    """uint8 codes [N, K] -> uint8 [N, K/2], element 2i in the low nibble."""
    return (code[:, 0::2] & 0xF) | ((code[:, 1::2] & 0xF) << 4)


def unpack_nibbles_along_k(b: np.ndarray) -> np.ndarray:
    out = np.empty((b.shape[0], b.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2], out[:, 1::2] = b & 0xF, b >> 4
    return out


def e2m1_to_f32(code: np.ndarray) -> np.ndarray:
    v = E2M1_VALUES[code & 7]
    return np.where(code & 8, -v, v).astype(np.float32)


def mx_dequantize(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """values float32 [N, K] (element grid), scale bytes [N, K/32] -> float32 [N, K]."""
    N, K = values.shape
    return (mx_blocks(values) * e8m0_to_f32(scale)[..., None]).reshape(N, K)


# --------------------------------------------------------------------------------------------------
# E4M3 (W8A8_MXFP8)


def e4m3_round(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round float32 magnitudes y >= 0 to float8_e4m3fn (half to even, saturating at 448).

    Returns (byte without sign 0..0x7E as uint8, value float32).  Normal range (y >= 2^-6):
    3 mantissa bits, rounded on the float32 bit pattern; below 2^-6: multiples of 2^-9.
    """
    y = y.astype(np.float32)
    u = y.view(np.uint32)
    r = ((u + np.uint32(0x7FFFF) + ((u >> 20) & 1)) & np.uint32(0xFFF00000)).view(np.float32)
    r = np.minimum(r, np.float32(E4M3_MAX))
    sub = y < np.float32(2.0**-6)
    m_sub = np.rint(y * np.float32(512.0))  # 0..8 (8 == 2^-6, the smallest normal: byte 0x08)
    r = np.where(sub, m_sub * np.float32(2.0**-9), r).astype(np.float32)
    ru = r.view(np.uint32)
    byte_norm = (((ru >> 23).astype(np.int32) - 120) << 3) | ((ru >> 20) & 7).astype(np.int32)
    byte = np.where(sub, m_sub.astype(np.int32), byte_norm).astype(np.uint8)
    return byte, r


def e4m3_to_f32(b: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes -> float32 (0x7F / 0xFF -> NaN)."""
    b = b.astype(np.int32)
    exp, man = (b >> 3) & 0xF, b & 7
    mag = np.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * np.ldexp(1.0, exp - 7))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# MX codes with sign: one definition for both element types


def _with_sign(mag: np.ndarray, neg: np.ndarray, sign_bit: int) -> np.ndarray:
    """Sign-magnitude codes; zero magnitudes stay +0 (never the negative-zero code)."""
    return mag | ((neg & (mag > 0)).astype(np.uint8) << sign_bit)


MX_ELEMENTS = {  # element type -> (emax_elem, rounding, sign bit)
    "e2m1": (2, e2m1_round, 3),
    "e4m3": (8, e4m3_round, 7),
}


def mx_quantize(w: np.ndarray, elem: str) -> tuple[np.ndarray, np.ndarray]:
    """-> (codes uint8 [N, K] with sign bit, scale bytes uint8 [N, K/32]); exponent chosen by block error."""
    emax, round_fn, sign_bit = MX_ELEMENTS[elem]
    N, K = w.shape
    mag, neg, scale = mx_quantize_blocks(w, emax, round_fn)
    return _with_sign(mag, neg, sign_bit).reshape(N, K), scale


def mx_ocp_quantize(w: np.ndarray, elem: str) -> tuple[np.ndarray, np.ndarray]:
    """The OCP floor rule alone (the quality baseline the chosen exponent must never lose to)."""
    emax, round_fn, sign_bit = MX_ELEMENTS[elem]
    N, K = w.shape
    scale = mx_ocp_scale(w, emax)
    blocks = mx_blocks(w)
    mag, _ = round_fn(np.abs(blocks) * pow2_f32(-(scale.astype(np.int32) - 127))[..., None])
    return _with_sign(mag, blocks < 0, sign_bit).reshape(N, K), scale


def mxfp4_quantize(w):
    return mx_quantize(w, "e2m1")


def mxfp8_quantize(w):
    return mx_quantize(w, "e4m3")


def mxfp4_ocp_quantize(w):
    return mx_ocp_quantize(w, "e2m1")


def mxfp8_ocp_quantize(w):
    return mx_ocp_quantize(w, "e4m3")
