"""numba fast paths: bfloat16 bits in, ascendV1 tensors out, bit-identical to ``numerics``.

Each kernel reads the uint16 bf16 matrix once, row by row (or block by block), keeping only
row-sized scratch buffers, and writes straight into caller-provided output arrays.  Kernels are
single-threaded (the converter runs one process per core) and compiled with ``cache=True``.

Every kernel returns -1 on success, or the index of the first row holding a NaN/Inf (bf16
exponent bits all ones); the caller turns that into ``numerics.NonFiniteWeight``.

Bit identity with the reference rests on doing the same IEEE operations in the same order:
float32 division ``w / s``, ``rint`` (half to even), float64 sums that are either exact
(int4: integer-valued terms) or follow the same fixed halving tree (MX block errors).
Nothing here uses fastmath, except where the sums are exact whatever the order: the int4 code
sums, and the MX float32 SSE screen (``_e2m1_screen``: it only decides blocks whose margin exceeds
every rounding error; the rest take the exact float64 tree).

Vector width: numba types uint16/uint32 arithmetic as 64-bit, which quarters the lanes of element
loops, and only vectorises loops whose indices it can prove non-negative.  So the element-level
bit work is done in small LLVM intrinsics (``_fp4_block16``, ``_fp8_byte``, ``_e2m1_screen``, ...)
that stay in 16- or 32-bit lanes (whole MX blocks as LLVM vectors), and inner loops run over slices
indexed from 0.  Check with
``kernel.inspect_asm(kernel.signatures[0])`` under a fresh NUMBA_CACHE_DIR (cached code cannot be
inspected): the hot loops should show ymm (AVX2) or zmm (AVX-512) registers.

The MX kernel skips the second exponent candidate when it provably cannot win (see the comment
in ``_mx_kernel``); the reference always evaluates both, and the tests check they agree.

Compilation: a conversion normally runs these functions compiled ahead of time (``aot``, through
``base.load_kernels``: no numba in the workers). Run here, by numba's JIT (where that build is not
possible, and in the tests), ``cache=True`` stores machine code next to
this file (``__pycache__``), or in NUMBA_CACHE_DIR / a per-user cache dir when that is not writable.
A cold compile of all kernels takes ~10 s; a cache load ~0.2 s (after numba's own start, ~0.7 s).
Call ``warmup()`` once in a parent process before forking workers so that they do not all compile.
"""

from __future__ import annotations

import math

import numpy as np

from .numba_cache import numba_cache_dir

numba_cache_dir()  # numba's pickled cache only in a private directory: checked before numba reads any of it

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from .numerics import BLOCK, E2M1_THRESHOLDS, E2M1_VALUES, E8M0_ZERO_BLOCK, MX_SCREEN_MARGIN
from . import numerics as _nm

_E2M1 = E2M1_VALUES.copy()


_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _c32(v):
    return ir.Constant(_I32, v)


# Small LLVM-level helpers.  numba types integer arithmetic on uint16/uint32 as 64-bit, which halves
# or quarters the vector width of the element loops; these keep every step in 32-bit lanes, so
# LLVM vectorises the loops that call them at full width (16 lanes with AVX-512).


@intrinsic
def _u32_as_f32(typingctx, x):
    """Reinterpret uint32 bits as float32 (a register bitcast: vectorises, unlike an array view)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _F32)
    return types.float32(types.uint32), codegen


@intrinsic
def _f32_as_u32(typingctx, x):
    """Reinterpret float32 bits as uint32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _I32)
    return types.uint32(types.float32), codegen


def _k(ty, v):
    """Constant v of type ty, splat when ty is a vector type (the helpers below build either)."""
    return ir.Constant(ty, [v] * ty.count) if isinstance(ty, ir.VectorType) else ir.Constant(ty, v)


def _as(ty, elem):
    """ty (scalar or vector) with its element type replaced by elem."""
    return ir.VectorType(elem, ty.count) if isinstance(ty, ir.VectorType) else elem


def _e2m1_code_ir(b, y):
    """numerics.e2m1_round code of float32 y >= 0 (i32; or a vector of them), by float rounding
    instead of the 7 threshold comparisons of E2M1_THRESHOLDS (fewer vector ops).

    As in ``_e2m1_err``: with c = 2^(max(ey, 0) + 22) (ey = floor(log2 y)), s = y + c rounds y half
    to even onto the E2M1 spacing of y's binade (0.5 below 2, then 2^(ey-1)), which is the
    threshold pattern; s stays in c's binade, so bits(s) - bits(c) = k, the number of spacings.
    The codes of binade ey >= 0 start at 2 ey (1 -> 2, 2 -> 4, 4 -> 6), below 1 at 0, so
    code = k + 2 max(ey, 0).  Saturation: y is first clamped to the float32 just below 7, which
    rounds to 6 (code 7) like every y > 5, so the code never exceeds 7 and c stays finite."""
    ti = _as(y.type, _I32)
    u = b.bitcast(y, ti)
    u = b.select(b.icmp_unsigned("<", u, _k(ti, 0x40DFFFFF)), u, _k(ti, 0x40DFFFFF))  # min(y, 7 - ulp)
    e = b.select(b.icmp_unsigned(">", u, _k(ti, 0x3F800000)), u, _k(ti, 0x3F800000))  # max(y, 1)
    cb = b.add(b.and_(e, _k(ti, 0x7F800000)), _k(ti, 22 << 23))  # bits of c
    k = b.sub(b.bitcast(b.fadd(b.bitcast(u, y.type), b.bitcast(cb, y.type)), ti), cb)
    return b.add(k, b.lshr(b.sub(cb, _k(ti, 149 << 23)), _k(ti, 22)))  # + 2 max(ey, 0)


@intrinsic
def _e2m1_code_f32(typingctx, y):
    """``_e2m1_code_ir`` of float32 y >= 0 as uint8 (for the tests)."""
    def codegen(context, b, signature, args):
        return b.trunc(_e2m1_code_ir(b, args[0]), _I8)
    return types.uint8(types.float32), codegen


def _signed_ir(b, c, sign_bit):
    """c | sign_bit unless c == 0 (zero magnitudes stay +0); sign_bit is 0 or the code's sign bit (i32)."""
    z = _k(c.type, 0)
    return b.or_(c, b.select(b.icmp_unsigned("!=", c, z), sign_bit, z))


def _fp4_ir(b, wd, p):
    """MXFP4 byte(s) (i8) of the bf16 pair(s) in i32 wd (element 2i in the low half), magnitudes times
    float32 p (2^-e), E2M1 codes with sign, low nibble first.
    The signs of both nibbles at once: bit 15 -> 3, bit 31 -> 7, kept where the nibble is nonzero,
    i.e. where bit 3 of nibble + 7 is set (codes <= 7: no carry between the nibbles)."""
    ti = wd.type
    lo = b.fmul(b.bitcast(b.and_(b.shl(wd, _k(ti, 16)), _k(ti, 0x7FFF0000)), p.type), p)
    hi = b.fmul(b.bitcast(b.and_(wd, _k(ti, 0x7FFF0000)), p.type), p)
    c = b.or_(_e2m1_code_ir(b, lo), b.shl(_e2m1_code_ir(b, hi), _k(ti, 4)))
    sg = b.and_(wd, _k(ti, 0x80008000))
    sg = b.or_(b.lshr(sg, _k(ti, 12)), b.lshr(sg, _k(ti, 24)))  # bits 3, 7 (and 19, cleared below)
    c = b.or_(c, b.and_(sg, b.add(c, _k(ti, 0x77))))
    return b.trunc(c, _as(ti, _I8))


@intrinsic
def _fp4_block(typingctx, src, i0, p, dst):
    """dst[i0 + j] = the MXFP4 byte of bf16 pair src[i0 + j] scaled by p, for j < 16: one MX block in
    float32 lanes (src: uint32 words of bf16 pairs, dst: uint8, both 1-D contiguous; the 16-bit
    ``_fp4_block16`` serves all but tiny blocks): one 16-lane load, compute and store, without the
    per-block loop set-up (alias checks, remainder) a 16-iteration numba loop pays."""
    def codegen(context, b, signature, args):
        n = BLOCK // 2
        sa = context.make_array(signature.args[0])(context, b, args[0])
        da = context.make_array(signature.args[3])(context, b, args[3])
        vi = ir.VectorType(_I32, n)
        vf = ir.VectorType(_F32, n)
        wd = b.load(b.bitcast(b.gep(sa.data, [args[1]]), vi.as_pointer()), align=4)
        pv = b.insert_element(ir.Constant(vf, ir.Undefined), args[2], _c32(0))
        pv = b.shuffle_vector(pv, ir.Constant(vf, ir.Undefined), ir.Constant(vi, [0] * n))
        b.store(_fp4_ir(b, wd, pv), b.bitcast(b.gep(da.data, [args[1]]), ir.VectorType(_I8, n).as_pointer()), align=1)
        return context.get_dummy_value()
    return types.none(src, i0, types.float32, dst), codegen


#: E2M1 thresholds as bf16 bit patterns, every one made inclusive (y > t  <=>  bits >= bits(t) + 1)
_E2M1_T16 = [int(np.float32(t).view(np.uint32) >> 16) + (0 if inc else 1) for t, inc in E2M1_THRESHOLDS]

#: smallest scale exponent e for which ``_fp4_block16`` is exact (see there)
FP4_I16_EMIN = -124


@intrinsic
def _fp4_block16(typingctx, src, k0, sh, dst):
    """dst[k0 / 2 + j] = the MXFP4 bytes of bf16 src[k0 : k0 + 32] (one block) scaled by 2^-e, with
    sh = e << 7, e >= FP4_I16_EMIN, in 16-bit lanes (twice the lanes of ``_fp4_block``).

    y = |x| 2^-e is exact in bf16, so its bits are |x|'s minus e << 7 (the exponent field), compared
    with the bf16 thresholds.  Exact whenever y is a normal bf16.  Otherwise the code is 0 either
    way: y < 2^-126 gives bits <= 127 or negative (signed compares; a subnormal x gives bits below
    0x3E80 = 0.25 while e >= -124), the true y is below 0.25; the subtraction saturates (vpsubsw),
    so a huge y stays >= every threshold (code 7) and a tiny one below them."""
    def codegen(context, b, signature, args):
        n = BLOCK
        sa = context.make_array(signature.args[0])(context, b, args[0])
        da = context.make_array(signature.args[3])(context, b, args[3])
        v16 = ir.VectorType(_I16, n)
        x = b.load(b.bitcast(b.gep(sa.data, [args[1]]), v16.as_pointer()), align=2)
        shv = b.insert_element(ir.Constant(v16, ir.Undefined), b.trunc(args[2], _I16), _c32(0))
        shv = b.shuffle_vector(shv, ir.Constant(v16, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))
        ssub = cgutils.get_or_insert_function(b.module, ir.FunctionType(v16, [v16, v16]), "llvm.ssub.sat.v32i16")
        yb = b.call(ssub, [b.and_(x, _k(v16, 0x7FFF)), shv])
        c = _k(v16, 0)
        for t in _E2M1_T16:
            c = b.add(c, b.zext(b.icmp_signed(">=", yb, _k(v16, t)), v16))
        # sign (bit 15 -> bit 3) where the code is nonzero (bit 3 of code + 7)
        c = b.or_(c, b.and_(b.and_(b.lshr(x, _k(v16, 12)), _k(v16, 8)), b.add(c, _k(v16, 7))))
        # element 2i (low half of each 32-bit pair) -> low nibble, 2i + 1 -> high nibble
        v32 = b.bitcast(c, ir.VectorType(_I32, n // 2))
        byte = b.trunc(b.or_(v32, b.lshr(v32, _k(v32.type, 12))), ir.VectorType(_I8, n // 2))
        b.store(byte, b.bitcast(b.gep(da.data, [b.sdiv(args[1], ir.Constant(args[1].type, 2))]),
                                ir.VectorType(_I8, n // 2).as_pointer()), align=1)
        return context.get_dummy_value()
    return types.none(src, k0, sh, dst), codegen


@intrinsic
def _fp8_byte(typingctx, x, p):
    """One output byte of MXFP8: bf16 bits x, magnitude scaled by p (float32 2^-e), rounded to E4M3
    as numerics.e4m3_round (normal range on the float32 bits, saturated at 448 = 0x43E00000 by an
    integer min; below 2^-6 rint(y * 512)), with sign."""
    def codegen(context, b, signature, args):
        x, p = args
        xx = b.zext(x, _I32)
        y = b.fmul(b.bitcast(b.shl(b.and_(xx, _c32(0x7FFF)), _c32(16)), _F32), p)
        u = b.bitcast(y, _I32)
        rn = b.and_(b.add(b.add(u, _c32(0x7FFFF)), b.and_(b.lshr(u, _c32(20)), _c32(1))), _c32(0xFFF00000))
        rn = b.select(b.icmp_unsigned("<", rn, _c32(0x43E00000)), rn, _c32(0x43E00000))
        cn = b.sub(b.lshr(rn, _c32(20)), _c32(960))  # ((exp - 120) << 3) | mantissa
        rint = cgutils.get_or_insert_function(b.module, ir.FunctionType(_F32, [_F32]), "llvm.rint.f32")
        ms = b.fptoui(b.call(rint, [b.fmul(y, ir.Constant(_F32, 512.0))]), _I32)
        c = b.select(b.fcmp_ordered("<", y, ir.Constant(_F32, 2.0**-6)), ms, cn)
        c = _signed_ir(b, c, b.and_(b.lshr(xx, _c32(8)), _c32(0x80)))
        return b.trunc(c, _I8)
    return types.uint8(types.uint16, types.float32), codegen


@intrinsic
def _block_absmax(typingctx, arr, off):
    """max over row[off : off + 32] of the bf16 bits without sign (uint16): one 32 x i16 vector
    load and a umax reduction (the scalar loop compiles to a serial chain).  arr: 1-D contiguous uint16."""
    def codegen(context, b, signature, args):
        ary = context.make_array(signature.args[0])(context, b, args[0])
        vty = ir.VectorType(_I16, BLOCK)
        ptr = b.bitcast(b.gep(ary.data, [args[1]]), vty.as_pointer())
        v = b.and_(b.load(ptr, align=2), ir.Constant(vty, [0x7FFF] * BLOCK))
        red = cgutils.get_or_insert_function(b.module, ir.FunctionType(_I16, [vty]), "llvm.vector.reduce.umax.v32i16")
        return b.call(red, [v])
    return types.uint16(arr, types.intp), codegen


@intrinsic
def _abs16(typingctx, x):
    """bf16 bits without the sign bit (uint16)."""
    def codegen(context, builder, signature, args):
        return builder.and_(args[0], ir.Constant(_I16, 0x7FFF))
    return types.uint16(types.uint16), codegen


@intrinsic
def _as_i16(typingctx, x):
    """uint16 bits as int16 (the same i16 register)."""
    def codegen(context, builder, signature, args):
        return args[0]
    return types.int16(types.uint16), codegen


@intrinsic
def _i8_sat(typingctx, x):
    """int32 -> int8, clamped to [-128, 127] (a saturating pack on x86, where a plain truncation
    takes a byte shuffle per 128-bit lane)."""
    def codegen(context, b, signature, args):
        x = b.select(b.icmp_signed("<", args[0], _c32(127)), args[0], _c32(127))
        x = b.select(b.icmp_signed(">", x, _c32(-128)), x, _c32(-128))
        return b.trunc(x, _I8)
    return types.int8(types.int32), codegen


@intrinsic
def _bf16_f32(typingctx, x):
    """bf16 bits x as float32 (uint16 -> float32, exact)."""
    def codegen(context, b, signature, args):
        return b.bitcast(b.shl(b.zext(args[0], _I32), _c32(16)), _F32)
    return types.float32(types.uint16), codegen


@intrinsic
def _bf16_abs_f32(typingctx, x):
    """|bf16 bits x| as float32 (uint16 -> float32)."""
    def codegen(context, b, signature, args):
        return b.bitcast(b.shl(b.and_(b.zext(args[0], _I32), _c32(0x7FFF)), _c32(16)), _F32)
    return types.float32(types.uint16), codegen


@intrinsic
def _e2m1_err(typingctx, y):
    """y - e2m1_round(y) for float32 0 <= y < 8 (exact).

    The E2M1 grid has spacing 2^(ey-1) in binade [2^ey, 2^(ey+1)), ey >= 0, and 0.5 below 1, so
    v = (y + c) - c with c = 2^(max(ey, 0) + 22) rounds y to it, half to even (y < c: the sum stays
    in c's binade, whose ulp is the spacing; the subtraction is exact), which is exactly the
    threshold pattern of numerics.E2M1_THRESHOLDS; then v = min(v, 6) saturates (7 -> 8 -> 6 as well).
    Plain IEEE instructions (no fast-math flags reach them), so (y + c) - c is not folded to y."""
    def codegen(context, b, signature, args):
        y = args[0]
        ey = b.lshr(b.bitcast(y, _I32), _c32(23))
        ey = b.select(b.icmp_unsigned(">", ey, _c32(127)), ey, _c32(127))
        c = b.bitcast(b.shl(b.add(ey, _c32(22)), _c32(23)), _F32)
        v = b.fsub(b.fadd(y, c), c)
        v = b.select(b.fcmp_ordered("<", v, ir.Constant(_F32, 6.0)), v, ir.Constant(_F32, 6.0))
        return b.fsub(y, v)
    return types.float32(types.float32), codegen


@intrinsic
def _e4m3_err(typingctx, y):
    """y - e4m3_round(y) for float32 y >= 0 (exact)."""
    def codegen(context, b, signature, args):
        y = args[0]
        u = b.bitcast(y, _I32)
        rn = b.and_(b.add(b.add(u, _c32(0x7FFFF)), b.and_(b.lshr(u, _c32(20)), _c32(1))), _c32(0xFFF00000))
        rn = b.select(b.icmp_unsigned("<", rn, _c32(0x43E00000)), rn, _c32(0x43E00000))
        rint = cgutils.get_or_insert_function(b.module, ir.FunctionType(_F32, [_F32]), "llvm.rint.f32")
        rs = b.fmul(b.call(rint, [b.fmul(y, ir.Constant(_F32, 512.0))]), ir.Constant(_F32, 2.0**-9))
        r = b.select(b.fcmp_ordered("<", y, ir.Constant(_F32, 2.0**-6)), rs, b.bitcast(rn, _F32))
        return b.fsub(y, r)
    return types.float32(types.float32), codegen


@njit(cache=True)
def _row_to_f32(w, n, xu):
    """bf16 row n -> float32 bits in xu (uint32 view of a float32 buffer); returns max |bits|."""
    row = w[n]
    xf = xu.view(np.float32)
    m = np.uint16(0)
    for k in range(row.shape[0]):
        b = row[k]
        xf[k] = _bf16_f32(b)
        m = max(m, _abs16(b))
    return m


@njit(cache=True)
def _bits_to_f32(bits16, tmp_u):
    tmp_u[0] = np.uint32(bits16) << 16
    return tmp_u.view(np.float32)[0]


# ------------------------------------------------------------------------------------------ int8


@njit(cache=True)
def _pow2_int8_scale(amax):
    """``numerics.int8_pow2_scale`` of one row's float32 amax > 0: the smallest power of two s with
    amax / s <= 127, at least 2^-149."""
    E = np.int32(math.frexp(np.float64(amax))[1] - 1)  # exact: float32 -> float64 is
    e = max(E - 6, np.int32(-149))
    if np.float64(amax) > 127.0 * math.ldexp(1.0, e):
        e += 1
    return np.float32(math.ldexp(1.0, e))


@njit(cache=True)
def _int8_rows(w, q_out, s_out, pow2):
    """Per-row symmetric int8: s = amax / 127, or with ``pow2`` the power-of-two scale that clips nothing;
    q = clip(rint(w / s), -127, 127). Returns the first row holding Inf/NaN, else -1."""
    N, K = w.shape
    xu = np.empty(K, dtype=np.uint32)
    xf = xu.view(np.float32)
    tmp = np.empty(1, dtype=np.uint32)
    lo = np.float32(-127.0)
    hi = np.float32(127.0)
    for n in range(N):
        m = _row_to_f32(w, n, xu)
        if m >= 0x7F80:
            return n
        if m == 0:
            s = np.float32(1.0)
        elif pow2:
            s = _pow2_int8_scale(_bits_to_f32(m, tmp))
        else:
            s = _bits_to_f32(m, tmp) / np.float32(127.0)
        s_out[n, 0] = s
        for k in range(K):
            t = np.rint(xf[k] / s)
            t = min(max(t, lo), hi)
            q_out[n, k] = np.int8(t)
    return -1


@njit(cache=True)
def int8_kernel(w, q_out, s_out):
    return _int8_rows(w, q_out, s_out, False)


@njit(cache=True)
def int8_pow2_kernel(w, q_out, s_out):
    """W8A8_DYNAMIC with power-of-two row scales (weights decoded from MXFP4)."""
    return _int8_rows(w, q_out, s_out, True)


# ------------------------------------------------------------------------------------------ int4


@njit(cache=True)
def _bf16_range(x):
    """(hi, lo, m) of bf16 bits x: max(x, 0), min(x, 0) as float32 and the largest |bits|.

    Integer reductions on the bits (which vectorise; float max / min reductions do not without
    fast-math): as int16, the bits of non-negative floats are >= 0 and ordered like the floats, so
    smax = max(int16 bits, 0) is the bits of max(x, 0); as uint16, negative floats are above all
    non-negative ones and ordered by magnitude, so umax is the most negative value's bits if any
    is negative (umax >= 0x8000).  m = max(smax, umax & 0x7FFF): >= 0x7F80 iff x has a NaN/Inf."""
    smax = np.int16(0)
    umax = np.uint16(0)
    for k in range(x.shape[0]):
        b = x[k]
        smax = max(smax, _as_i16(b))
        umax = max(umax, b)
    hi = _bf16_f32(np.uint16(smax))
    lo = _bf16_f32(umax) if umax >= 0x8000 else np.float32(0.0)
    return hi, lo, max(np.uint16(smax), _abs16(umax))


@njit(cache=True)
def _int4_row(w, n, qrow, qsum, s_out, bias_out):
    """Row n: its scale (``numerics.int4_scale``), scale_bias, and its codes in qrow; -1, or n if non-finite."""
    row = w[n]
    hi, lo, m = _bf16_range(row)
    if m >= 0x7F80:
        return n
    s = max(hi / np.float32(7.0), -lo / np.float32(8.0))
    if m == 0:
        s = np.float32(1.0)
    elif not s > 0:
        s = np.float32(_nm.INT4_MIN_SCALE)
    s_out[n, 0] = s
    chunks = qsum.shape[0]
    _int4_row_codes(row, s, qrow, chunks, qsum)
    sd = np.float64(s)
    for c in range(chunks):
        bias_out[n, c] = np.float32(8.0 * np.float64(qsum[c]) * sd)
    return -1


@njit(cache=True, fastmath={"reassoc"})
def _int4_row_codes(x, s, qrow, chunks, qsum):
    """Codes of bf16 bits x into qrow (int8), q = clip(rint(x / s), -8, 7), and their sums over
    ``chunks`` contiguous chunks.  The sums are of integers, |sum| <= 8 * K < 2^24: exact in
    float32 in any order (the only fast-math op)."""
    K = x.shape[0]
    lo = np.float32(-8.0)
    hi = np.float32(7.0)
    L = K // chunks
    for c in range(chunks):
        xc = x[c * L:(c + 1) * L]  # slices: indices from 0 vectorise
        qc = qrow[c * L:(c + 1) * L]
        acc = np.float32(0.0)
        for k in range(L):
            t = min(max(np.rint(_bf16_f32(xc[k]) / s), lo), hi)
            qc[k] = _i8_sat(np.int32(t))
            acc += t
        qsum[c] = np.int64(acc)


@njit(cache=True)
def int4_kernel(w, packed_out, s_out, bias_out):
    """W4A8_DYNAMIC: packed_out int8 [N/2, K], s_out float32 [N, 1], bias_out float32 [N, chunks]."""
    N, K = w.shape
    q0 = np.empty(K, dtype=np.int8)
    q1 = np.empty(K, dtype=np.int8)
    qsum = np.empty(bias_out.shape[1], dtype=np.int64)
    for j in range(N // 2):
        bad = _int4_row(w, 2 * j, q0, qsum, s_out, bias_out)
        if bad >= 0:
            return bad
        bad = _int4_row(w, 2 * j + 1, q1, qsum, s_out, bias_out)
        if bad >= 0:
            return bad
        for k in range(K):
            packed_out[j, k] = np.int8((q0[k] & 0xF) | (q1[k] << 4))
    return -1


@njit(cache=True)
def _fp16_ceil(s):
    """numerics.fp16_ceil of float32 s >= 0, at least 2^-24 (numerics.int4_group_scale's floor):
    float16 normals (s >= 2^-14) by clearing the 13 float32 mantissa bits float16 lacks and stepping
    up if any was set; below, multiples of 2^-24 (exact float32 ops)."""
    if s >= np.float32(2.0**-14):
        u = _f32_as_u32(s)
        r = u & np.uint32(0xFFFFE000)
        if r != u:
            r = r + np.uint32(0x2000)
        return min(_u32_as_f32(np.uint32(r)), np.float32(65504.0))
    v = np.float32(np.ceil(s * np.float32(2.0**24))) * np.float32(2.0**-24)
    return max(v, np.float32(2.0**-24))


@njit(cache=True)
def _int4_group_row(w, n, group, seg, qrow, qseg, s_out, bias_out):
    """Row n of per-group int4: group scales (``numerics.int4_group_scale``), codes in qrow, and
    scale_bias (``numerics.int4_group_scale_bias``: integer sums over segments of ``seg`` inputs,
    which never straddle a group or a chunk); -1, or n if non-finite."""
    row = w[n]
    K = row.shape[0]
    per = group // seg
    for g in range(K // group):
        xg = row[g * group:(g + 1) * group]
        hi, lo, m = _bf16_range(xg)
        if m >= 0x7F80:
            return n
        if hi > 0 or lo < 0:
            s = _fp16_ceil(max(hi / np.float32(7.0), -lo / np.float32(8.0)))
        else:
            s = np.float32(1.0)
        s_out[n, g] = s
        _int4_row_codes(xg, s, qrow[g * group:(g + 1) * group], per, qseg[g * per:(g + 1) * per])
    chunks = bias_out.shape[1]
    L = K // chunks
    for c in range(chunks):
        acc = np.float64(0.0)
        k = c * L
        while k < (c + 1) * L:
            g = k // group
            end = min((g + 1) * group, (c + 1) * L)
            isum = np.int64(0)
            for t in range(k // seg, end // seg):
                isum += qseg[t]
            acc += np.float64(isum) * np.float64(s_out[n, g])
            k = end
        bias_out[n, c] = np.float32(8.0 * acc)
    return -1


@njit(cache=True)
def int4_group_kernel(w, group, seg, packed_out, s_out, bias_out):
    """W4A8_DYNAMIC per group: packed_out int8 [N/2, K], s_out float32 [N, K/group]
    (weight_scale_second), bias_out float32 [N, chunks]; seg = gcd(group, K / chunks)."""
    N, K = w.shape
    q0 = np.empty(K, dtype=np.int8)
    q1 = np.empty(K, dtype=np.int8)
    qseg = np.empty(K // seg, dtype=np.int64)
    for j in range(N // 2):
        bad = _int4_group_row(w, 2 * j, group, seg, q0, qseg, s_out, bias_out)
        if bad >= 0:
            return bad
        bad = _int4_group_row(w, 2 * j + 1, group, seg, q1, qseg, s_out, bias_out)
        if bad >= 0:
            return bad
        for k in range(K):
            packed_out[j, k] = np.int8((q0[k] & 0xF) | (q1[k] << 4))
    return -1


# ------------------------------------------------------------------------------------------ MX


@njit(cache=True)
def _tree64(d):
    """numerics.block_sse_tree on a 32-vector of float64 squares (in place, constant trip counts)."""
    for j in range(16):
        d[j] = d[j] + d[j + 16]
    for j in range(8):
        d[j] = d[j] + d[j + 8]
    for j in range(4):
        d[j] = d[j] + d[j + 4]
    for j in range(2):
        d[j] = d[j] + d[j + 2]
    return d[0] + d[1]


def _splat(b, vty, x):
    v = b.insert_element(ir.Constant(vty, ir.Undefined), x, _c32(0))
    return b.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count))


def _halving_sum(b, v):
    """Sum of the lanes of float vector v by the fixed halving tree (lanes j + j + h)."""
    while v.type.count > 1:
        h = v.type.count // 2
        v = b.fadd(b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h)))),
                   b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h, 2 * h)))))
    return b.extract_element(v, _c32(0))


@intrinsic
def _e2m1_screen(typingctx, row, k0, p0):
    """(S0, S1) = float32 sums of d0^2 and (2 d1)^2 over the block row[k0 : k0 + 32] (bf16 bits), d0 and
    d1 the E2M1 rounding errors under scales 2^-e0 (p0) and 2^-e1, e1 = e0 + 1 (a saturating block).

    d0 as ``_e2m1_err`` (y < 8 here).  2 d1 without a second product: y1 = y0 / 2, so
    2 (y1 - round(y1)) = y0 - round2(y0), round2 onto twice the E2M1 grid {0, 1, 2, 3, 4, 6, 8}
    (spacing 1 below 4, 2 in [4, 8); y0 < 8 never saturates it): c = 2^(max(ey, 1) + 22).  Exact
    when y1 is a normal float32; below, both are < 2^-125, whose squares vanish next to S0 >= 2^-10.

    Why a screen is exact: d = y - v is exact in float32 (as in the reference), so with T0, T1 the
    exact sums, |S - T| <= ~6 * 2^-24 T (each square rounds once, then 5 levels of additions;
    squares that underflow to float32 subnormals add < 2^-149 each, negligible as T0 >= 2^-10 for a
    saturating E2M1 block: its largest y0 > 6 is >= 6 + 2^-5), and the reference's float64 trees
    are within ~6 * 2^-53 T.  So when S1 < S0 (1 - margin) with margin = 2^-12, 4 T1 < T0 (1 - 2^-13)
    and the reference's 4 tree(d1^2) < tree(d0^2) holds too (e1 wins); when S1 > S0 (1 + margin)
    it fails (e0).  Anything in between goes to ``_mx_exact_row``."""
    def codegen(context, b, signature, args):
        n = BLOCK
        ra = context.make_array(signature.args[0])(context, b, args[0])
        v16 = ir.VectorType(_I16, n)
        vi = ir.VectorType(_I32, n)
        vf = ir.VectorType(_F32, n)
        x = b.load(b.bitcast(b.gep(ra.data, [args[1]]), v16.as_pointer()), align=2)
        a = b.bitcast(b.shl(b.zext(b.and_(x, _k(v16, 0x7FFF)), vi), _k(vi, 16)), vf)
        y = b.fmul(a, _splat(b, vf, args[2]))
        u = b.bitcast(y, vi)

        def rounded(lo_bits):  # (y + c) - c, c = 2^(max(ey, ey(lo)) + 22)
            m = b.select(b.icmp_unsigned(">", u, _k(vi, lo_bits)), u, _k(vi, lo_bits))
            c = b.bitcast(b.add(b.and_(m, _k(vi, 0x7F800000)), _k(vi, 22 << 23)), vf)
            return b.fsub(b.fadd(y, c), c)

        v0 = rounded(0x3F800000)
        v0 = b.select(b.fcmp_ordered("<", v0, _k(vf, 6.0)), v0, _k(vf, 6.0))
        d0 = b.fsub(y, v0)
        d1 = b.fsub(y, rounded(0x40000000))
        s0 = _halving_sum(b, b.fmul(d0, d0))
        s1 = _halving_sum(b, b.fmul(d1, d1))
        return context.make_tuple(b, signature.return_type, [s0, s1])
    return types.UniTuple(types.float32, 2)(row, k0, types.float32), codegen


@njit(cache=True)
def _mx_exact_row(row, satb, sate, nsat, pf, win, fp8, d0, d1):
    """win[t] = e1 wins for each saturating block t of a row, by the exact rule of
    numerics.mx_quantize_blocks: squares in float64, summed by the fixed halving tree (_tree64).
    Element-wise loops of constant length (no reductions): vectorised without fast-math."""
    for t in range(nsat):
        k0 = satb[t] * BLOCK
        blk = row[k0:k0 + BLOCK]
        p0 = pf[satb[t]]
        p1 = _u32_as_f32(np.uint32(127 - sate[t]) << 23)
        for j in range(BLOCK):
            a = _bf16_abs_f32(blk[j])
            if fp8:
                e0 = np.float64(_e4m3_err(a * p0))
                e1 = np.float64(_e4m3_err(a * p1))
            else:
                e0 = np.float64(_e2m1_err(a * p0))
                e1 = np.float64(_e2m1_err(a * p1))
            d0[j] = e0 * e0
            d1[j] = e1 * e1
        win[t] = 4.0 * _tree64(d1) < _tree64(d0)


@njit(cache=True)
def _mx_kernel(w, codes_out, scale_out, emax_elem, fp8, margin):
    """Shared MX driver: per block choose e0 / e0+1 by SSE, write element codes (with sign) and E8M0.

    codes_out: uint8 [N, K/2] (fp8=False, E2M1 packed along K, low nibble first) or [N, K] (E4M3).

    Per row: (1) block maxima on the bf16 bits; (2) per block the OCP exponent e0, its scale and
    whether the block saturates under e0 (branch-free, vectorised); (3) the saturating blocks only:
    both candidates with their SSE, e1 = e0 + 1 kept where it wins (E2M1: a float32 screen decides
    all but ~0.1% of them, see ``_e2m1_screen``, the rest take the exact float64 tree; E4M3: always
    the exact tree, a third of its saturating blocks tie exactly); (4) the codes of the whole row,
    each block under the exponent it kept, one block per intrinsic call (E2M1: ``_fp4_block16`` on
    the bf16 bits, 16-bit lanes, packed straight into the output bytes; blocks with an exponent
    below FP4_I16_EMIN in float32 lanes, ``_fp4_block``). Deciding before coding writes every code
    once: coding all blocks under e0 first, then recoding the blocks e1 won (~10% of them, on
    Gaussian-like weights), cost the E2M1 kernel ~5-9% more time and the E4M3 one ~8-18%.
    Skipping (3) for the other blocks is exact: when no element saturates under e0 (y <= ymax_elem),
    the e1 grid restricted to [0, ymax] is a subset of the e0 grid, so every element's e0 error is
    <= its e1 error and the rounded sums keep 4*sse1 < sse0 false: e0 wins.
    """
    N, K = w.shape
    nb = K // BLOCK
    pf = np.empty(nb, dtype=np.float32)
    ev = np.empty(nb, dtype=np.int32)
    bm = np.empty(nb, dtype=np.uint16)
    satf = np.empty(nb, dtype=np.bool_)
    satb = np.empty(nb, dtype=np.int64)
    sate = np.empty(nb, dtype=np.int32)
    winv = np.empty(nb, dtype=np.bool_)
    winu = np.empty(nb, dtype=np.bool_)
    undb = np.empty(nb, dtype=np.int64)
    unde = np.empty(nb, dtype=np.int32)
    undt = np.empty(nb, dtype=np.int64)
    d0 = np.empty(BLOCK, dtype=np.float64)
    d1 = np.empty(BLOCK, dtype=np.float64)
    ymax = np.float32(448.0) if fp8 else np.float32(6.0)
    for n in range(N):
        row = w[n]
        srow = scale_out[n]
        for blk in range(nb):
            bm[blk] = _block_absmax(row, blk * BLOCK)
        mx = np.uint16(0)
        for blk in range(nb):
            mx = max(mx, bm[blk])
        if mx >= 0x7F80:
            return n
        # per block, branch-free and vectorised (whether a block saturates is data-dependent, ~40%
        # of them: a branch per block mispredicts); the saturating ones are listed after
        for blk in range(nb):
            m = np.int32(bm[blk])
            E = max(m >> 7, 1) - 127  # floor(log2(amax)); subnormal amax: -126, clamped below like -127
            e0 = max(E - emax_elem, -127)
            p0 = _u32_as_f32(np.uint32(127 - e0) << 23)
            zero = m == 0
            pf[blk] = np.float32(0.0) if zero else p0  # all-zero block: every y is 0, codes 0
            ev[blk] = 0 if zero else e0
            srow[blk] = np.uint8(E8M0_ZERO_BLOCK if zero else e0 + 127)
            # saturates under e0, and e1 = e0 + 1 differs from e0 (not clamped at -127)
            satf[blk] = (E - emax_elem + 1 > -127) & (_u32_as_f32(np.uint32(m) << 16) * p0 > ymax)
        nsat = 0
        for blk in range(nb):
            satb[nsat] = blk
            sate[nsat] = ev[blk] + 1
            nsat += np.int64(satf[blk])
        # (3) the saturating blocks' exponents, before any code is written: each block's codes are
        # computed once, under the exponent it keeps
        if fp8:
            # E4M3: about a third of the saturating blocks tie exactly (4 sse1 == sse0), which no
            # screen can decide; the exact rule directly is cheaper
            _mx_exact_row(row, satb, sate, nsat, pf, winv, fp8, d0, d1)
        else:
            nund = 0
            for t in range(nsat):  # branch-free (the outcome is data-dependent)
                blk = satb[t]
                s0, s1 = _e2m1_screen(row, blk * BLOCK, pf[blk])
                win = s1 < s0 * (np.float32(1.0) - margin)
                lose = s1 > s0 * (np.float32(1.0) + margin)
                winv[t] = win
                # neither: too close for the screen, the exact rule decides
                undb[nund] = blk
                unde[nund] = sate[t]
                undt[nund] = t
                nund += np.int64(not (win | lose))
            if nund > 0:
                _mx_exact_row(row, undb, unde, nund, pf, winu, fp8, d0, d1)
                for i in range(nund):
                    winv[undt[i]] = winu[i]
        for t in range(nsat):  # branch-free: e1 = e0 + 1 where it won
            blk = satb[t]
            e = ev[blk] + np.int32(winv[t])
            ev[blk] = e
            pf[blk] = _u32_as_f32(np.uint32(127 - e) << 23)
            srow[blk] = np.uint8(e + 127)
        # (4) the codes of the whole row, one block per intrinsic call
        orow = codes_out[n]
        if fp8:
            for blk in range(nb):
                p = pf[blk]
                k0 = blk * BLOCK
                for j in range(BLOCK):
                    orow[k0 + j] = _fp8_byte(row[k0 + j], p)
        else:
            row32 = row.view(np.uint32)
            for blk in range(nb):
                e = ev[blk]
                if e >= FP4_I16_EMIN:
                    _fp4_block16(row, blk * BLOCK, e << 7, orow)
                else:  # amax < 2^-122 (subnormal products): float32 lanes
                    _fp4_block(row32, blk * (BLOCK // 2), pf[blk], orow)
    return -1


@njit(cache=True)
def mxfp4_kernel(w, packed_out, scale_out, margin=MX_SCREEN_MARGIN):
    return _mx_kernel(w, packed_out, scale_out, 2, False, margin)


@njit(cache=True)
def mxfp8_kernel(w, codes_out, scale_out, margin=MX_SCREEN_MARGIN):
    return _mx_kernel(w, codes_out, scale_out, 8, True, margin)


#: bf16 bits of the E2M1 value of each code 0..15 (bit 3 the sign)
_E2M1_BF16_BITS = (_E2M1.view(np.uint32) >> 16).astype(np.uint16)
_E2M1_BF16_BITS = np.concatenate([_E2M1_BF16_BITS, _E2M1_BF16_BITS | np.uint16(0x8000)])


@njit(cache=True)
def mxfp4_decode_kernel(codes, scales, out):
    """MXFP4 codes (uint8 [N, K/2], the even element in the low nibble) and E8M0 scales (uint8 [N, K/32])
    -> the exact values as bf16 bits (uint16 [N, K]): each code's bf16 bits with the block's exponent
    added to the exponent field (zeros keep theirs). The caller keeps the scales where every product is
    a normal bf16 (``mx_schemes.decode_mxfp4_bf16``). Returns -1."""
    n, half = codes.shape
    lut = _E2M1_BF16_BITS
    for i in range(n):
        crow = codes[i]
        orow = out[i]
        for b in range(half // 16):
            shift = np.int32(scales[i, b]) - 127
            for j in range(16):
                c = crow[b * 16 + j]
                for h in range(2):
                    v = np.int32(lut[(c >> (4 * h)) & 15])
                    if v & 0x7F80:
                        v += shift << 7
                    orow[2 * (b * 16 + j) + h] = np.uint16(v)
    return -1


def warmup(writable: bool = True) -> None:
    """Compile (or load from the numba cache) every conversion kernel on a tiny input (the calibrated
    path's kernels, ``gptq_kernels``, load on first use there).
    ``writable=False``: only the signatures for read-only input, the mmap views a conversion's
    workers pass (the others load on first use; ~50 ms less before the workers can start)."""
    w1 = np.zeros((2, 32), dtype=np.uint16)
    w1.setflags(write=False)  # the converter passes read-only mmap views: a separate numba signature
    _warm(w1)
    if writable:
        _warm(np.zeros((2, 32), dtype=np.uint16))


def _warm(w) -> None:
    int8_kernel(w, np.empty((2, 32), np.int8), np.empty((2, 1), np.float32))
    int8_pow2_kernel(w, np.empty((2, 32), np.int8), np.empty((2, 1), np.float32))
    for chunks in (1, 16):
        int4_kernel(w, np.empty((1, 32), np.int8), np.empty((2, 1), np.float32), np.empty((2, chunks), np.float32))
        int4_group_kernel(w, 32, 32 if chunks == 1 else 2, np.empty((1, 32), np.int8), np.empty((2, 1), np.float32),
                          np.empty((2, chunks), np.float32))
    mxfp4_kernel(w, np.empty((2, 16), np.uint8), np.empty((2, 1), np.uint8))
    mxfp8_kernel(w, np.empty((2, 32), np.uint8), np.empty((2, 1), np.uint8))
    codes, scales = np.zeros((2, 16), np.uint8), np.full((2, 1), 127, np.uint8)
    codes.setflags(write=w.flags.writeable)
    scales.setflags(write=w.flags.writeable)
    mxfp4_decode_kernel(codes, scales, np.empty((2, 32), np.uint16))
