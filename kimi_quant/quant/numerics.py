"""Plain numpy reference numerics for every codec: the definition the fast kernels must match bit for bit.

Everything here is vectorised numpy and meant to be read.  Conventions shared by all schemes:

* Input ``w`` is float32 ``[N, K]`` (in the converter: exact widenings of bfloat16).  Non-finite
  input raises :class:`NonFiniteWeight` (a ``ValueError``).
* "round" is IEEE round-half-to-even (``np.rint``); divisions ``w / s`` are float32 divisions.
* Floating-point sums whose rounding could depend on order are either exact by construction
  (integer-valued terms) or accumulated in a fixed order that the kernels copy.

Schemes
-------
W8A8_DYNAMIC  s = float32(amax / 127); q = clip(rint(w / s), -127, 127).
W4A8_DYNAMIC  int4 per row, the smallest scale that clips nothing: max(max(w)/7, -min(w)/8) (``int4_scale``);
              per group of G inputs (--group-size) the same rule per group, rounded up to float16
              (``int4_group_scale``: the loader rounds the group scale to float16).
W4A8_MXFP     E2M1 + E8M0 per 32 along K, exponent chosen from {OCP rule e0, e0 + 1} by block SSE.
W8A8_MXFP8    E4M3 + E8M0 per 32 along K, exponent chosen likewise from {OCP rule, OCP rule + 1}.

All-zero rows/blocks: int scales are 1.0 (never 0 or NaN); MX scale byte is 127 (2^0); codes are 0. A row
so small that its int scale underflows to 0 (only F32 weights ~1e-45 can be) counts as all-zero.
"""

from __future__ import annotations

import numpy as np

#: relative margin of the float32 SSE screen of ``kernels._mx_kernel`` (E2M1); the tests also run the
#: kernel with an infinite margin, where every saturating block takes the exact rule.
MX_SCREEN_MARGIN = np.float32(2.0**-12)

BLOCK = 32

#: W4A8_DYNAMIC scale of a nonzero row whose rule gives a float32 underflow (|w| < ~2^-146: float32
#: input only, bf16 cannot hold such values): the smallest positive float32, so scales stay > 0.
INT4_MIN_SCALE = np.float32(2.0**-149)
#: largest K the W4A8_DYNAMIC kernel sums codes for exactly (float32 sums of |q| <= 8: 8 K < 2^24)
INT4_MAX_K = 1 << 21

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


def int8_pow2_scale(amax: np.ndarray) -> np.ndarray:
    """float32 scale per row: the smallest power of two s with amax / s <= 127 (1.0 for all-zero rows).

    For a row decoded from MXFP4 (E2M1 x 2^e per block of 32; the largest block's amax is 4 or 6 x 2^e_max)
    s = 2^(e_max - 4), and the int8 grid holds every E2M1 value of each block whose exponent is within 3 of
    e_max (0.5 x 2^e is a multiple of s), so such rows are represented exactly.  A power of two is also exact
    in the BF16 the loader keeps ``weight_scale`` in."""
    amax = np.asarray(amax, np.float32)
    nz = amax > 0
    E = floor_log2(np.where(nz, amax, np.float32(1.0)))
    e = np.maximum(E - 6, -149)  # amax / 2^(E-6) is in [64, 128): one more when it passes 127
    e = np.where(amax.astype(np.float64) > 127.0 * np.exp2(e.astype(np.float64)), e + 1, e)  # exact in float64
    return np.where(nz, np.ldexp(np.float32(1.0), e.astype(np.int32)), np.float32(1.0)).astype(np.float32)


def int8_pow2_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """-> (q int8 [N, K] in [-127, 127], s float32 [N]) with s = ``int8_pow2_scale``: nothing clips."""
    check_finite(w)
    s = int8_pow2_scale(np.abs(w).max(axis=1))
    q = np.clip(np.rint(w / s[:, None]), -127, 127).astype(np.int8)
    return q, s


# --------------------------------------------------------------------------------------------------
# W4A8_DYNAMIC


def int4_codes(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """q = clip(rint(w / s), -8, 7) as float32 (w float32 [N, K], s float32 [N] per row)."""
    return np.clip(np.rint(w / s[:, None]), np.float32(-8.0), np.float32(7.0))


def int4_scale(w: np.ndarray) -> np.ndarray:
    """Per-row int4 scale: the smallest that clips nothing, s = max(max(w) / 7, -min(w) / 8).

    The largest positive weight maps to code 7 and the most negative one to code >= -8, so every
    weight is only rounded, never clipped; a row whose largest magnitude is negative uses the -8
    code and a step 7/8 of the absmax rule's.  float32 divisions, then the max; all-zero rows get
    1.0, nonzero rows whose scale underflows get INT4_MIN_SCALE.

    Why not a search: the weights a row's error matters most on are its largest ones (they carry
    the layer's output); a scale search on weight MSE clipped them by 25-30% and raised SmolLM2's
    perplexity 9.5 -> 92.7 (plain absmax rounding: 19.9).  scripts/bench_quality.py compares rules
    on model output and input-weighted error.
    """
    hi = np.maximum(w.max(axis=1), np.float32(0.0)).astype(np.float32)
    lo = np.minimum(w.min(axis=1), np.float32(0.0)).astype(np.float32)
    s = np.maximum(hi / np.float32(7.0), -lo / np.float32(8.0)).astype(np.float32)
    nz = (hi > 0) | (lo < 0)
    return np.where(nz, np.where(s > 0, s, INT4_MIN_SCALE), np.float32(1.0)).astype(np.float32)


def int4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """-> (q int8 [N, K] in [-8, 7], s float32 [N]): q = clip(rint(w / s), -8, 7), s = ``int4_scale``."""
    check_finite(w)
    s = int4_scale(w)
    return int4_codes(w, s).astype(np.int8), s


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
    qsum = q.reshape(N, chunks, K // chunks).sum(axis=2, dtype=np.int64).astype(np.float64)
    with np.errstate(over="ignore"):
        return (8.0 * qsum * s.astype(np.float64)[:, None]).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# W4A8_DYNAMIC per group (description "group_size": G > 0)
#
# The loader multiplies weight_scale [N, 1] by weight_scale_second [N, K/G] in float32 and rounds the
# product to float16 (vLLM-Ascend w4a8.py, AscendW4A8DynamicFusedMoEMethod.process_scale): that float16
# value is the scale the kernel uses.  So the group scale is chosen on the float16 grid and written
# whole into weight_scale_second, with weight_scale = 1.0: the product is exact and its float16
# rounding changes nothing.

#: group sizes msModelSlim writes per-group W4A8_DYNAMIC with (its GROUP_SIZE_LIST)
INT4_GROUP_SIZES = (32, 64, 128, 256)
FP16_MAX = np.float32(65504.0)
FP16_TINY = np.float32(2.0**-24)  # smallest positive float16 (a subnormal)


def fp16_ceil(s: np.ndarray) -> np.ndarray:
    """The smallest float16 value >= s, as float32 (s float32 > 0, finite); saturates at 65504."""
    s = np.asarray(s, np.float32)
    with np.errstate(over="ignore"):
        h = s.astype(np.float16)  # round to nearest even (inf above 65520)
    h = np.where(h.astype(np.float32) < s, np.nextafter(h, np.float16(np.inf)), h)
    return np.minimum(h.astype(np.float32), FP16_MAX)


def int4_group_scale(w: np.ndarray, group: int) -> np.ndarray:
    """float32 [N, K/G]: per group of G inputs the smallest scale that clips nothing (``int4_scale``
    of the group), rounded up to float16 (up: rounding never makes it clip).  Groups of zeros get 1.0;
    nonzero groups at least 2^-24 (the smallest float16 step)."""
    N, K = w.shape
    s = int4_scale(w.reshape(N * (K // group), group))
    return np.maximum(fp16_ceil(s), FP16_TINY).reshape(N, K // group)


def int4_group_codes(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """q = clip(rint(w / s_group), -8, 7) as float32 (s float32 [N, K/G])."""
    group = w.shape[1] // s.shape[1]
    return np.clip(np.rint(w / np.repeat(s, group, axis=1)), np.float32(-8.0), np.float32(7.0))


def int4_group_quantize(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (q int8 [N, K] in [-8, 7], group scales float32 [N, K/G])."""
    check_finite(w)
    s = int4_group_scale(w, group)
    return int4_group_codes(w, s).astype(np.int8), s


def int4_effective_scale(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """The scale the loader hands the kernel: float16(weight_scale * weight_scale_second) as float32."""
    with np.errstate(over="ignore"):
        prod = np.asarray(first, np.float32).reshape(-1, 1) * np.asarray(second, np.float32)
        return prod.astype(np.float32).astype(np.float16).astype(np.float32)


def int4_group_scale_bias(q: np.ndarray, s: np.ndarray, matmul: str | None) -> np.ndarray:
    """8 * sum_k q[n,k] * s[n, k // G]: [N, 1] (gate/up) or [N, 16] over 16 contiguous K chunks (down).

    Per chunk, in increasing group order: the integer sum of the codes the chunk shares with a group
    times that group's scale (exact in float64: |sum| < 2^21, s a float16 value), accumulated in
    float64; then 8 * the total rounded once to float32.  The kernel repeats these additions."""
    N, K = q.shape
    group = K // s.shape[1]
    chunks = 16 if matmul == "down" else 1
    L = K // chunks
    q64 = q.astype(np.int64)
    s64 = s.astype(np.float64)
    out = np.empty((N, chunks), np.float64)
    for c in range(chunks):
        acc = np.zeros(N, np.float64)
        k = c * L
        while k < (c + 1) * L:
            g = k // group
            end = min((g + 1) * group, (c + 1) * L)
            acc = acc + q64[:, k:end].sum(axis=1).astype(np.float64) * s64[:, g]
            k = end
        out[:, c] = acc
    with np.errstate(over="ignore"):
        return (8.0 * out).astype(np.float32)


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


def on_mxfp4_grid(w: np.ndarray, first_rows: int = 8) -> bool:
    """Whether every 32-block along K of float32 ``w`` [N, K] is E2M1 values times one power of two (a
    weight decoded from MXFP4).  Such a block is one on the finest exponent that holds its largest value,
    the OCP rule's 2^(floor(log2 amax) - 2) (E2M1 values doubled stay E2M1 values up to 6), so one
    exponent per block is checked.  The first ``first_rows`` rows go first, so that a float weight costs
    almost nothing."""
    N, K = w.shape
    if K % BLOCK or N == 0:
        return False
    for rows in (slice(0, first_rows), slice(first_rows, N)):
        b = np.abs(w[rows]).reshape(-1, K // BLOCK, BLOCK)
        if b.size == 0:
            continue
        amax = b.max(axis=2)
        E = floor_log2(np.where(amax > 0, amax, np.float32(1.0)).astype(np.float32))
        with np.errstate(over="ignore"):
            y2 = b * pow2_f32(3 - E)[..., None]  # 2 |w| / 2^(E - 2), exact (or inf: then not on the grid)
        if not ((y2 == np.rint(y2)) & ((y2 <= 4) | (y2 == 6) | (y2 == 8) | (y2 == 12))).all():
            return False
    return True
