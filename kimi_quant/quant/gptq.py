"""Calibrated (GPTQ-class) quantization: error feedback in each codec's own grid.

A codec's data-free rule rounds every weight on its own.  Given the statistic of a Linear's
inputs, ``H = (1/n) sum_t x_t x_t^T`` ([K, K], over the n calibration tokens that reach it), the
error that matters for the layer's output is the input-weighted one, per output row n:

    err_n = (w_n - q_n)^T H (w_n - q_n)          (sum over rows: tr(dW H dW^T))

GPTQ (Frantar et al., 2022) lowers it by quantizing one input column at a time and spreading each
column's rounding error over the columns not yet quantized, through the inverse Hessian.  Here the
grid is exactly the codec's: the scales (per row for the int schemes, per block of 32 for MX) are
fixed first, then every column is rounded on that grid, so the result is written in the same bytes
as the data-free path and read back by the same ``dequantize``.

Entry point: ``gptq_quantize(codec, w, matmul, H, GPTQConfig(...))`` (the GPTQ modules use the codecs,
never the reverse).  This module holds ``GPTQConfig``, the shared algorithm (``gptq_run``) and the
per-row choice; the rest is one module per job: ``gptq_factor`` (H prepared, permuted and inverted),
``gptq_judge`` (the input-weighted error of a candidate, and the choice among candidates),
``gptq_clip`` (the candidate grids: clip ratios, powers of two, MX exponents judged on H),
``gptq_kernels`` (the numba kernels) and ``gptq_cuda`` (the block kernel on a CUDA device).  Every codec supplies:

* ``gptq_grids(w, matmul, data_free)``: one or more candidate grids (``base.Grid``: scales + element
  kind); each is run through GPTQ and every row keeps the candidate with the smallest input-weighted error;
* ``encode(codes, grid, matmul)``: the codes on that grid -> the on-disk tensors.

Determinism: the same input, config, torch build and thread count give the same bytes (the CPU path
runs fixed-order float32/float64 torch ops and numba kernels without fastmath; ``act_order`` sorts
with a stable sort; choices between candidates are float64 argmins, see ``gptq_judge.Judge``).

Cost, for a routed expert's [3072, 3584]: the factor (a float64 Cholesky and a float32 triangular
inverse by matrix products), GPTQ's lazy-batch products (~N K^2 multiply-adds) and a few float32
[N, K] x [K, K] products to judge candidates; the clip ratios (and power-of-two scales) are screened on
an O(N K m) estimate first (``gptq_clip.clip_ranked``), a GPTQ result's error comes out of GPTQ itself, and the
guard's data-free codes are judged only on the rows where an O(N K m) lower bound of their error does not
already lose (``Judge.fast_unless_beaten``).  scripts/bench_gptq.py
measures it against one same-thread matmul.  Memory beyond the Hessian given: one K x K working matrix
(float32 above FLOAT64_MAX_K, in place) and a few [N, K] arrays (``working_set_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from . import numerics as nm
from .base import Grid
from .gptq_clip import clip_ranked, clippable, grid_rows, mx_grid_on_h, pick_rows, scale_candidates
from .gptq_factor import FLOAT64_MAX_K, Factor, hessian_factor
from .gptq_judge import Judge, values_of
from .gptq_refine import descend, objective
from .numba_cache import warn_once


DEVICES = ("cpu", "cuda", "npu")
#: the clip ratios judged per row of an int4 per-channel grid (chosen on SmolLM2-135M: docs/quality.md)
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
#: weights on the MXFP4 grid (with the power-of-two candidates): their rows' few largest values sit in the
#: top 32-blocks, so deeper clips can pay (docs/quality.md); screened like the others, so a few O(N K m) scores
MXFP4_CLIP_RATIOS = CLIP_RATIOS + (0.7, 0.65, 0.6)


#: weights on the MXFP4 grid: ``GPTQConfig.hessian_shrink`` (docs/quality.md)
MXFP4_HESSIAN_SHRINK = 0.15


@dataclass(frozen=True)
class GPTQConfig:
    """Options of the calibrated path (the defaults are the measured ones: scripts/bench_quality.py).

    damp:       fraction of the mean of diag(H) added to the diagonal before inverting it (keeps the
                inverse well conditioned where inputs are nearly collinear or rarely active).
    act_order:  quantize columns in order of decreasing H[k, k] (the most active inputs first, while
                the most columns remain to absorb their error).
    block_size: columns per lazy-update block (speed only; the result is the same up to rounding).
    device:     "cpu" (default), "cuda" or "npu" (needs torch_npu) for the torch work.
    guard:      per row, keep the data-free codes when they have the smaller input-weighted error
                (so the calibrated result never loses to the data-free one on H; one extra [N,K]x[K,K]
                product).
    clip_ratios: int4 per-channel grids only (per-group scales must stay float16; MX block scales are
                powers of two): candidate scales r x (the codec's scale), per row; the row keeps the ratio whose
                input-weighted error tr(dW H dW^T) is smallest.  Clipping a row's largest weights costs
                little on H when their inputs are quiet, and the finer step helps every other weight.
                () or (1.0,): the codec's scale only.
    clip_finalists: clip ratios judged exactly per row (beside the codec's scale) after a cheap screen
                of all of them (``clip_ranked``); with no more ratios than this, every one is judged.
    clip_after: judge the ratios after GPTQ (every ratio runs GPTQ: len(clip_ratios) x the cost)
                instead of on plain rounding before it (one GPTQ run, the default).
    pow2_scales: int4 per-channel grids only: also offer, per row, the two powers of two bracketing the
                codec's scale (the largest <= it, the smallest > it) as candidate scales, judged with the clip
                ratios.  Weights decoded from MXFP4 are E2M1 levels times each 32-block's power of two; a
                power-of-two row scale holds whole blocks of them exactly, where r x (absmax / 7) holds none.
    gptq_finalists: with clip ratios or power-of-two scales: per row, the best this many scales of the clip
                search (judged on plain rounding) each run through GPTQ, and the row keeps the one with the smallest
                error after it (1: the best one only; ``clip_after`` runs all of them).  ~gptq_finalists x GPTQ's cost.
    hessian_shrink: a in [0, 1): every step (the scale choice, GPTQ, the descent) works on (1 - a) H + a diag(H)
                instead of H: the calibration inputs' correlations trusted less than their per-input energies
                (0: H as given).
    refine_passes: int grids: after GPTQ, this many passes of coordinate descent over each row's codes on
                GPTQ's own objective, the scales kept (``gptq_refine``; 0: none).
    mx_exponents: MX grids only: "sse" (the data-free rule's per-block exponent: OCP or one above, by
                block squared error), "hessian" (the same two candidates judged per block on the block's
                diagonal 32 x 32 part of H: d_b H_bb d_b^T of plain rounding), or "both" (each grid runs
                GPTQ, every row keeps the better; 2x the cost).
    """

    damp: float = 0.01
    act_order: bool = True
    block_size: int = 128
    device: str = "cpu"
    guard: bool = True
    clip_ratios: tuple = CLIP_RATIOS
    clip_after: bool = False
    mx_exponents: str = "sse"
    clip_finalists: int = 2
    pow2_scales: bool = False
    gptq_finalists: int = 1
    refine_passes: int = 0
    hessian_shrink: float = 0.0

    def __post_init__(self):
        if not (0.0 <= self.damp < 10.0) or self.damp != self.damp:
            raise ValueError(f"GPTQConfig.damp must be in [0, 10), got {self.damp}")
        if int(self.block_size) != self.block_size or self.block_size < 1:
            raise ValueError(f"GPTQConfig.block_size must be a positive integer, got {self.block_size}")
        if not all(0.0 < float(r) <= 1.0 for r in self.clip_ratios):
            raise ValueError(f"GPTQConfig.clip_ratios must lie in (0, 1], got {self.clip_ratios}")
        if int(self.clip_finalists) != self.clip_finalists or self.clip_finalists < 1:
            raise ValueError(f"GPTQConfig.clip_finalists must be a positive integer, got {self.clip_finalists}")
        if int(self.gptq_finalists) != self.gptq_finalists or self.gptq_finalists < 1:
            raise ValueError(f"GPTQConfig.gptq_finalists must be a positive integer, got {self.gptq_finalists}")
        if int(self.refine_passes) != self.refine_passes or self.refine_passes < 0:
            raise ValueError(f"GPTQConfig.refine_passes must be a non-negative integer, got {self.refine_passes}")
        if not (0.0 <= self.hessian_shrink < 1.0):
            raise ValueError(f"GPTQConfig.hessian_shrink must be in [0, 1), got {self.hessian_shrink}")
        if not isinstance(self.pow2_scales, bool):
            raise ValueError(f"GPTQConfig.pow2_scales must be True or False, got {self.pow2_scales!r}")
        if self.mx_exponents not in ("sse", "hessian", "both"):
            raise ValueError(f"GPTQConfig.mx_exponents must be sse, hessian or both, got {self.mx_exponents!r}")
        if self.device not in DEVICES:
            raise ValueError(f"GPTQConfig.device must be one of {', '.join(DEVICES)}, got {self.device!r}")


def for_mxfp4_weights(cfg: GPTQConfig) -> GPTQConfig:
    """``cfg`` for a weight whose values are on the MXFP4 grid (a packed source or its BF16 decoding): each
    32-block is E2M1 levels times a power of two, which a power-of-two row scale holds; deeper clips; and H's
    correlations trusted less than its diagonal (docs/quality.md measures each on text unlike the calibration)."""
    return replace(cfg, pow2_scales=True, clip_ratios=MXFP4_CLIP_RATIOS, hessian_shrink=MXFP4_HESSIAN_SHRINK)


def torch_device(name: str):
    """The torch device of a ``--device`` name (refused with one line where torch has no such device)."""
    import torch

    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("GPTQ device 'cuda' requested but torch sees no CUDA device")
        return torch.device("cuda")
    if name == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise ValueError("GPTQ device 'npu' needs the torch_npu package") from None
        return torch.device("npu")
    return torch.device("cpu")


def _round_on_grid(w, s, grid: Grid, consts):
    """One column (or a block of columns) rounded on the codec's grid: (codes, values), torch tensors.

    int:  c = clip(rint(w / s), qmin, qmax), value c * s (float32 division, half to even, like numerics)
    e2m1: magnitude code = number of E2M1 thresholds passed by |w| / s (numerics.e2m1_round), sign bit 3
    e4m3: |w| / s saturated at 448 and cast to float8_e4m3fn (round half to even), sign bit 7
    Zero magnitudes always get the +0 code."""
    import torch

    if grid.kind == "int":
        c = torch.clamp(torch.round(w / s), grid.qmin, grid.qmax)
        return c, c * s
    y = w.abs() / s
    neg = w < 0
    if grid.kind == "e2m1":
        m = torch.zeros_like(y, dtype=torch.int16)
        for t, inclusive in nm.E2M1_THRESHOLDS:
            m += (y >= t) if inclusive else (y > t)
        mag = consts["e2m1"][m.long()]
        code = m | ((neg & (m > 0)).to(torch.int16) << 3)
    else:
        f8 = torch.clamp(y, max=nm.E4M3_MAX).to(torch.float8_e4m3fn)
        mag = f8.to(y.dtype)
        b = f8.view(torch.uint8).to(torch.int16)
        code = b | ((neg & (b > 0)).to(torch.int16) << 7)
    return code, torch.where(neg, -mag, mag) * s


def gptq_codes(w: np.ndarray, Uinv, grid: Grid, cfg: GPTQConfig, perm=None, kernel: bool = True):
    """GPTQ on ``grid`` -> codes int16 [N, K] (numpy); see ``gptq_run``."""
    return gptq_run(w, Uinv, grid, cfg, perm, kernel)[0]


_KINDS = {"int": 0, "e2m1": 1, "e4m3": 2}  # gptq_kernels.KIND_*
#: rows of the weight updated per product between lazy blocks (bounds the product's temporary)
UPDATE_ROWS = 4096


def gptq_run(w: np.ndarray, Uinv, grid: Grid, cfg: GPTQConfig, perm=None, kernel: bool = True):
    """GPTQ on ``grid``: float32 w [N, K], the upper Cholesky factor U of the (permuted) prepared H'^-1
    (torch float32, ``Factor.U``) -> (codes int16 [N, K] numpy, per-row sum of e^2 float64 [N]).

    Columns are processed in ``perm`` order (act-order) in blocks of ``cfg.block_size``; inside a
    block each column's error e = (w - q) / U[j, j] is pushed to the block's remaining columns, and
    the block's errors to all later columns in one product (the "lazy batch" form of GPTQ).  Since
    w - q = E U and U H' U^T = I, the row's sum of e^2 is its (w - q) H' (w - q)^T (up to float32
    rounding): the error of the result, without a product with H.
    On the CPU the inside of each block runs in a numba kernel (``gptq_kernels.gptq_block``, on the
    transposed matrix, tiled over rows: the same float32 operations as the torch loop, so the same
    codes); on CUDA in ``gptq_cuda``'s kernel (a thread per row: the same operations, up to the device's fused
    multiply-adds); ``kernel=False``, E4M3 grids or another device run the torch loop, the reference the tests
    compare with.  The products between blocks are torch float32 matmuls."""
    import torch

    dev = Uinv.device
    N, K = w.shape
    B = int(cfg.block_size)
    U = Uinv if Uinv.dtype == torch.float32 else Uinv.to(torch.float32)
    if kernel and dev.type == "cpu":
        from .gptq_kernels import gather_transposed, gptq_block, scatter_transposed

        order = np.ascontiguousarray(perm.cpu().numpy() if perm is not None else np.arange(K), np.int64)
        Wn = np.empty((K, N), dtype=np.float32)  # [K, N]: a block of columns is a block of rows
        gather_transposed(w, order, Wn)
        WT = torch.from_numpy(Wn)
        scale_t = np.ascontiguousarray(np.asarray(grid.scale, np.float32).T)  # [K // group, N]
        CT = np.empty((K, N), dtype=np.int16)
        ET = torch.empty((min(B, K), N), dtype=torch.float32)
        sq = np.zeros(N, dtype=np.float64)
        kind = _KINDS[grid.kind]
        qmin, qmax = np.float32(grid.qmin), np.float32(grid.qmax)
        for i1 in range(0, K, B):
            i2 = min(i1 + B, K)
            E1 = ET[:i2 - i1]
            ST = scale_t[order[i1:i2] // grid.group] if scale_t.shape[0] > 1 else np.broadcast_to(scale_t, (i2 - i1, N))
            gptq_block(Wn[i1:i2], np.ascontiguousarray(ST), np.ascontiguousarray(U[i1:i2, i1:i2].numpy()), kind,
                       qmin, qmax, CT[i1:i2], E1.numpy(), sq)
            for r1 in range(i2, K, UPDATE_ROWS):  # W[:, later] -= E1 U[block, later], transposed
                r2 = min(r1 + UPDATE_ROWS, K)
                WT[r1:r2].addmm_(U[i1:i2, r1:r2].T, E1, alpha=-1)
        codes = np.empty((N, K), dtype=np.int16)
        scatter_transposed(CT, order, codes)
        return codes, sq
    W = torch.tensor(w, dtype=torch.float32, device=dev)
    S = torch.tensor(np.repeat(grid.scale, grid.group, axis=1) if grid.group < K else
                     np.broadcast_to(grid.scale, (N, K)), dtype=torch.float32, device=dev)
    if perm is not None:
        W, S = W[:, perm].contiguous(), S[:, perm].contiguous()
    if kernel and dev.type == "cuda" and (blocks := _cuda_kernel(grid, B)) is not None:
        return _gptq_run_cuda(blocks, W, S, U, grid, B, perm)
    consts = {"e2m1": torch.tensor(nm.E2M1_VALUES, dtype=torch.float32, device=dev)}
    codes = torch.empty((N, K), dtype=torch.int16, device=dev)
    sq = torch.zeros(N, dtype=torch.float64, device=dev)
    for i1 in range(0, K, B):
        i2 = min(i1 + B, K)
        W1 = W[:, i1:i2].clone()
        E1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            wc = W1[:, i]
            c, v = _round_on_grid(wc, S[:, i1 + i], grid, consts)
            codes[:, i1 + i] = c.to(torch.int16)
            err = (wc - v) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E1[:, i] = err
            sq += err.to(torch.float64) ** 2
        if i2 < K:
            W[:, i2:] -= E1 @ U[i1:i2, i2:]
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return codes.cpu().numpy(), sq.cpu().numpy()


_CUDA_KERNEL: list = []  # [the gptq_cuda module, or None where it could not be loaded]: decided once per process


def _cuda_kernel(grid: Grid, block: int):
    """The CUDA block kernel (``gptq_cuda``) for ``grid``, or None: E4M3 grids, blocks above its
    ``MAX_BLOCK``, or a numba without a working CUDA target, or one whose kernel disagrees with the CPU
    kernel on a small problem (``cuda_self_check``; one warning, and the torch loop runs instead)."""
    if not _CUDA_KERNEL:
        try:
            from . import gptq_cuda

            cuda_self_check(gptq_cuda)
        except Exception as e:  # numba's CUDA target missing or broken: the reference loop still works
            warn_once(f"GPTQ's CUDA kernel is not available ({type(e).__name__}: {str(e)[:200]}); "
                      "the slower torch loop runs on the device instead")
            gptq_cuda = None
        _CUDA_KERNEL.append(gptq_cuda)
    k = _CUDA_KERNEL[0]
    return k if k is not None and grid.kind in ("int", "e2m1") and block <= k.MAX_BLOCK else None


def _gptq_run_cuda(k, W, S, U, grid: Grid, B: int, perm):
    """``gptq_run`` on CUDA with ``gptq_cuda``'s block kernel: W, S float32 [N, K] on the device (columns
    already in ``perm`` order), transposed so that a block of columns is a block of rows."""
    import torch

    N, K = W.shape
    WT, ST = W.T.contiguous(), S.T.contiguous()
    CT = torch.empty((K, N), dtype=torch.int16, device=WT.device)
    ET = torch.empty((min(B, K), N), dtype=torch.float32, device=WT.device)
    sq = torch.zeros(N, dtype=torch.float64, device=WT.device)
    kind = _KINDS[grid.kind]
    for i1 in range(0, K, B):
        i2 = min(i1 + B, K)
        E1 = ET[:i2 - i1]
        k.run_block(WT[i1:i2], ST[i1:i2], U[i1:i2, i1:i2], kind, grid.qmin, grid.qmax, CT[i1:i2], E1, sq)
        if i2 < K:  # W[:, later] -= E1 U[block, later], transposed
            WT[i2:].addmm_(U[i1:i2, i2:].T, E1, alpha=-1)
    codes = CT.T
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return codes.cpu().numpy(), sq.cpu().numpy()


def cuda_self_check(k, device: str = "cuda") -> float:
    """Run ``_gptq_run_cuda`` with kernel module ``k`` on a small seeded problem (three blocks, permuted
    columns, both W4A8 grid kinds) on ``device`` against the CPU kernel path: raises where more than a stray
    code differs (a fused multiply-add may move a code that sits on a rounding boundary, not more); returns
    the largest fraction of codes that differed."""
    import torch

    rng = np.random.default_rng(0)
    N, K, B = 40, 24, 8
    A = rng.standard_normal((K, K))
    U = torch.from_numpy(np.triu(0.2 * A + 3 * np.eye(K)).astype(np.float32))
    w = rng.standard_normal((N, K)).astype(np.float32)
    perm = torch.from_numpy(rng.permutation(K))
    cfg = GPTQConfig(block_size=B)
    worst = 0.0
    for grid in (Grid(np.full((N, 1), 0.3, np.float32), K, "int", -8, 7),
                 Grid(np.full((N, K // 8), 0.5, np.float32), 8, "e2m1")):
        want = gptq_run(w, U, grid, cfg, perm)[0]
        W = torch.from_numpy(w)[:, perm].contiguous().to(device)
        S = torch.from_numpy(np.repeat(grid.scale, grid.group, axis=1))[:, perm].contiguous().to(device)
        got = _gptq_run_cuda(k, W, S, U.to(device), grid, B, perm.to(device))[0]
        differ = float(np.mean(got != want))
        if differ > 0.02:
            raise RuntimeError(f"{differ:.0%} of its codes differ from the CPU kernel's on a test problem ({grid.kind})")
        worst = max(worst, differ)
    return worst


def gptq_quantize(codec, w: np.ndarray, matmul, hessian: np.ndarray, cfg: GPTQConfig | None = None):
    """The calibrated path: float32 ``w`` [N, K] and the statistic of this Linear's inputs,
    ``hessian`` = (1/n) sum_t x_t x_t^T [K, K] (float64 or float32) over the n calibration tokens
    reaching it -> the codec's on-disk tensors (the format of ``codec.out_specs``).

    GPTQ over the codec's candidate grids, per row the candidate (or, with ``cfg.guard``, the
    data-free codes) with the smallest input-weighted error (judged by ``Judge``: float32 products,
    float64 where candidates come close; a GPTQ result's error comes from GPTQ itself)."""
    cfg = cfg or GPTQConfig()
    w = np.ascontiguousarray(w, dtype=np.float32)
    codec.require(w.shape, matmul)
    nm.check_finite(w)
    N, K = w.shape
    dev = torch_device(cfg.device)
    if cfg.hessian_shrink:
        hessian = shrunk(np.asarray(hessian), cfg.hessian_shrink)
    factor = hessian_factor(hessian, K, cfg.damp, cfg.act_order, dev)
    judge = Judge(w[:0], np.asarray(hessian), dev)
    step = _rows_per_chunk(N, K)
    if step >= N:
        codes, grid = _quantize_rows(codec, w, matmul, factor, judge.for_rows(w), cfg)
        return codec.encode(codes, grid, matmul)
    # rows are independent problems given the factor: in chunks, bounding the [rows, K] working arrays
    codes = np.empty((N, K), dtype=np.int16)
    grids = []
    for r1 in range(0, N, step):
        rows = w[r1:r1 + step]
        codes[r1:r1 + len(rows)], g = _quantize_rows(codec, rows, matmul, factor, judge.for_rows(rows), cfg)
        grids.append(g)
    scale_bytes = None if grids[0].scale_bytes is None else np.concatenate([g.scale_bytes for g in grids])
    grid = Grid(np.concatenate([g.scale for g in grids]), grids[0].group, grids[0].kind, grids[0].qmin,
                grids[0].qmax, scale_bytes)
    return codec.encode(codes, grid, matmul)


def shrunk(hessian: np.ndarray, a: float) -> np.ndarray:
    """(1 - a) H + a diag(H), a new matrix of H's dtype."""
    out = hessian * hessian.dtype.type(1.0 - a)
    out[np.diag_indices_from(out)] = np.diagonal(hessian)
    return out


#: elements of the weight per chunk of rows (``grid_rows_per_chunk``)
ROW_CHUNK_ELEMS = 1 << 25


def _rows_per_chunk(N: int, K: int) -> int:
    """Rows quantized together: ROW_CHUNK_ELEMS / K (a routed expert's [3072, 3584] is one chunk), even
    (int4 packs row pairs), at least 2."""
    return max(2, (ROW_CHUNK_ELEMS // K) & ~1)


def _quantize_rows(codec, w: np.ndarray, matmul, factor: Factor, judge: Judge, cfg: GPTQConfig):
    """(codes [n, K], grid) of rows ``w`` [n, K]: the candidates, GPTQ on each, the per-row choice."""
    free = codec.fast_data_free_codes(w, matmul)
    grids = list(codec.gptq_grids(w, matmul, free))
    if cfg.mx_exponents != "sse":
        mx = [g for g in grids if g.kind in ("e2m1", "e4m3")]
        on_h = [mx_grid_on_h(w, g.kind, judge.hessian) for g in mx]
        grids = (on_h + [g for g in grids if all(g is not m for m in mx)]) if cfg.mx_exponents == "hessian" else grids + on_h
    ratios = tuple(float(r) for r in cfg.clip_ratios if float(r) != 1.0)
    known = []  # (grid, codes, float32 error) of plain roundings judged by the clip search
    if ratios or cfg.pow2_scales:  # int grids: the codec's scale and the other candidates, judged on H (per row)
        out = []
        for g in grids:
            if not clippable(g):
                out.append(g)
            elif cfg.clip_after:
                out += [g, *scale_candidates(g, ratios, cfg.pow2_scales)]
            else:
                out += clip_ranked(w, g, ratios, judge, known, cfg.clip_finalists, cfg.pow2_scales, cfg.gptq_finalists)
        grids = out
    cands = []  # (grid, codes, float32 error)
    Hs = objective(judge.hessian, factor.shift) if cfg.refine_passes and any(g.kind == "int" for g in grids) else None
    for grid in grids:
        codes, sq = gptq_run(w, factor.U, grid, cfg, factor.perm)
        if Hs is not None and grid.kind == "int":
            codes, gain = descend(w, codes, grid, Hs, cfg.refine_passes)
            sq = sq - gain
        cands.append((grid, codes, judge.from_gptq(values_of(codes, grid), sq, factor)))
    if cfg.guard:
        grid, codes = free
        err = next((e for g, c, e in known if np.array_equal(g.scale, grid.scale) and np.array_equal(c, codes)), None)
        if err is None:  # judged only on rows where it may beat the best GPTQ result
            err = judge.fast_unless_beaten(values_of(codes, grid), np.min([e for _, _, e in cands], axis=0), factor)
        cands.append((grid, codes, err))
    if len(cands) == 1:
        return cands[0][1], cands[0][0]
    best, _ = judge.choose([e for _, _, e in cands],
                           [lambda rows, g=g, c=c: values_of(c[rows], grid_rows(g, rows)) for g, c, _ in cands])
    codes = cands[0][1]
    for i in range(1, len(cands)):
        take = best == i
        if take.any():
            codes = np.where(take[:, None], cands[i][1], codes)
    return codes, pick_rows(best, [g for g, _, _ in cands])


def working_set_bytes(N: int, K: int, shrink: bool = False) -> int:
    """Bytes ``gptq_quantize`` of an [N, K] weight allocates beyond the weight and the Hessian it is
    given, at its peak (an upper bound): the K x K working matrix (float64 up to FLOAT64_MAX_K, where
    the Cholesky's output and its float32 copy coexist, with the judge's float32 triangle blocks and the
    kept copy of H: 29 B per entry; above it float32, in place, plus its preparation's row blocks),
    ~28 B per weight entry of one chunk of rows (the transposed copy, codes, candidates' values and
    differences), and the whole matrix's codes and encoded output (3 B per entry); with ``shrink``
    (``GPTQConfig.hessian_shrink``) a copy of H as received (float64 up to FLOAT64_MAX_K, else float32)."""
    rows = min(N, _rows_per_chunk(N, K))
    square = K * K * (20 + 9) if K <= FLOAT64_MAX_K else K * K * 4 + 3 * 8 * K * max(1, (1 << 24) // K)
    copy = K * K * (8 if K <= FLOAT64_MAX_K else 4) if shrink else 0
    return int(square + copy + 28 * rows * K + 3 * N * K + (64 << 20))


def gptq_quantize_bf16(codec, w_u16: np.ndarray, matmul, hessian: np.ndarray, cfg: GPTQConfig | None = None,
                       out: dict | None = None) -> dict:
    """``gptq_quantize`` from bf16 bits, filling ``out`` as ``Codec.quantize_bf16`` does."""
    from ..dtypes import bf16_to_f32

    return codec.fill(gptq_quantize(codec, bf16_to_f32(w_u16), matmul, hessian, cfg), w_u16.shape, matmul, out)
