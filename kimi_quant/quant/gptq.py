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

Entry point: ``Codec.quantize(w, matmul, hessian=H, gptq=GPTQConfig(...))``; this module holds the
shared algorithm (``gptq_codes``), the per-row guard and ``GPTQConfig``.  Every codec supplies:

* ``gptq_grids(w, matmul)``: one or more candidate grids (``Grid``: scales + element kind); each is
  run through GPTQ and every row keeps the candidate with the smallest input-weighted error;
* ``encode(codes, grid, matmul)``: the codes on that grid -> the on-disk tensors.

Determinism: the same input, config, torch build and thread count give the same bytes (the CPU path
runs fixed-order float32/float64 torch ops; ``act_order`` sorts with a stable sort).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import numerics as nm

DEVICES = ("cpu", "cuda", "npu")
#: measured on SmolLM2-135M (scripts/bench_quality.py --quick, W4A8_DYNAMIC + GPTQ, int4 on all 210
#: Linears, float-model Hessians): codec scale only 1.523x float ppl, this grid judged before GPTQ 1.281x;
#: full run (8 x 512 tokens each), with sequential Hessians as convert --calibrate: 1.569x -> 1.336x
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


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
    clip_after: judge the ratios after GPTQ (every ratio runs GPTQ: len(clip_ratios) x the cost)
                instead of on plain rounding before it (one GPTQ run, the default).
    """

    damp: float = 0.01
    act_order: bool = True
    block_size: int = 128
    device: str = "cpu"
    guard: bool = True
    clip_ratios: tuple = CLIP_RATIOS
    clip_after: bool = False

    def __post_init__(self):
        if not (0.0 <= self.damp < 10.0) or self.damp != self.damp:
            raise ValueError(f"GPTQConfig.damp must be in [0, 10), got {self.damp}")
        if int(self.block_size) != self.block_size or self.block_size < 1:
            raise ValueError(f"GPTQConfig.block_size must be a positive integer, got {self.block_size}")
        if not all(0.0 < float(r) <= 1.0 for r in self.clip_ratios):
            raise ValueError(f"GPTQConfig.clip_ratios must lie in (0, 1], got {self.clip_ratios}")
        if self.device not in DEVICES:
            raise ValueError(f"GPTQConfig.device must be one of {', '.join(DEVICES)}, got {self.device!r}")


@dataclass
class Grid:
    """The fixed quantization grid of one matrix [N, K].

    scale: float32 [N, K // group] (int schemes: group = K, one scale per row; MX: group = 32, the
           E8M0 block scale 2^e as float32, with ``exp`` holding e or None for an all-zero block).
    kind:  "int" (codes clip(rint(w / s), qmin, qmax)), "e2m1" or "e4m3" (sign-magnitude MX codes).
    """

    scale: np.ndarray
    group: int
    kind: str
    qmin: int = 0
    qmax: int = 0
    scale_bytes: np.ndarray | None = None  # MX: the E8M0 bytes written for ``scale``


def _device(name: str):
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


def _prepare_hessian(hessian: np.ndarray, K: int, damp: float, dev):
    """H as float64 on ``dev`` with dead inputs (H[k,k] == 0: never active in calibration) set to
    identity rows/columns and ``damp * mean(diag)`` added to the diagonal."""
    import torch

    H = np.asarray(hessian)
    if H.shape != (K, K):
        raise ValueError(f"hessian must be [K, K] = [{K}, {K}] for a weight with K={K} inputs, got {list(H.shape)}")
    if not np.isfinite(H).all():
        raise ValueError("hessian has non-finite entries")
    H = torch.tensor(H, dtype=torch.float64, device=dev)
    H = (H + H.T) * 0.5
    diag = torch.diagonal(H)
    dead = diag <= 0
    H[dead, :] = 0
    H[:, dead] = 0
    H[dead, dead] = 1.0
    mean = float(torch.diagonal(H)[~dead].mean()) if bool((~dead).any()) else 1.0
    H += torch.eye(K, dtype=torch.float64, device=dev) * (damp * mean)
    return H


def _inverse_cholesky(H):
    """Upper Cholesky factor of H^-1 (float64), adding more dampening if H is not positive definite."""
    import torch

    K = H.shape[0]
    mean = float(torch.diagonal(H).mean())
    extra = 0.0
    for _ in range(8):
        L, info = torch.linalg.cholesky_ex(H + torch.eye(K, dtype=H.dtype, device=H.device) * extra)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0:
                return U
        extra = mean * (1e-3 if extra == 0.0 else 10.0 * extra / mean)
    raise ValueError("hessian is not positive semi-definite (Cholesky failed even with extra dampening)")


def gptq_codes(w: np.ndarray, H, grid: Grid, cfg: GPTQConfig, perm=None, Uinv=None):
    """GPTQ on ``grid``: float32 w [N, K], prepared H (torch float64) -> codes int16 [N, K] (numpy).

    Columns are processed in ``perm`` order (act-order) in blocks of ``cfg.block_size``; inside a
    block each column's error e = (w - q) / U[j, j] is pushed to the block's remaining columns, and
    the block's errors to all later columns in one product (the "lazy batch" form of GPTQ).
    """
    import torch

    dev = H.device
    N, K = w.shape
    W = torch.tensor(w, dtype=torch.float32, device=dev)
    S = torch.tensor(np.repeat(grid.scale, grid.group, axis=1) if grid.group < K else
                     np.broadcast_to(grid.scale, (N, K)), dtype=torch.float32, device=dev)
    if perm is not None:
        W, S = W[:, perm], S[:, perm]
    U = Uinv.to(torch.float32)
    consts = {"e2m1": torch.tensor(nm.E2M1_VALUES, dtype=torch.float32, device=dev)}
    codes = torch.empty((N, K), dtype=torch.int16, device=dev)
    B = int(cfg.block_size)
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
        if i2 < K:
            W[:, i2:] -= E1 @ U[i1:i2, i2:]
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return codes.cpu().numpy()


def values_of(codes: np.ndarray, grid: Grid) -> np.ndarray:
    """float32 [N, K]: the weights the codes stand for (what ``dequantize`` of the encoded bytes gives)."""
    N, K = codes.shape
    s = np.repeat(grid.scale, grid.group, axis=1) if grid.group < K else np.broadcast_to(grid.scale, (N, K))
    if grid.kind == "int":
        v = codes.astype(np.float32)
    elif grid.kind == "e2m1":
        v = nm.e2m1_to_f32(codes.astype(np.uint8))
    else:
        v = nm.e4m3_to_f32(codes.astype(np.uint8))
    return (v * s).astype(np.float32)


def weighted_error(w: np.ndarray, deq: np.ndarray, hessian: np.ndarray) -> np.ndarray:
    """Per row (w - deq) H (w - deq)^T in float64: the input-weighted error of a quantized matrix."""
    d = w.astype(np.float64) - deq.astype(np.float64)
    return ((d @ np.asarray(hessian, np.float64)) * d).sum(axis=1)


def _weighted_error_t(d, H):
    return ((d @ H) * d).sum(dim=1)


def gptq_quantize(codec, w: np.ndarray, matmul, hessian: np.ndarray, cfg: GPTQConfig | None):
    """The calibrated path of ``Codec.quantize``: GPTQ over the codec's candidate grids, per row the
    candidate (or, with ``cfg.guard``, the data-free codes) with the smallest input-weighted error."""
    import torch

    cfg = cfg or GPTQConfig()
    nm.check_finite(w)
    N, K = w.shape
    dev = _device(cfg.device)
    H = _prepare_hessian(hessian, K, cfg.damp, dev)
    H_true = torch.tensor(np.asarray(hessian), dtype=torch.float64, device=dev)
    perm = None
    Hp = H
    if cfg.act_order:
        # stable: equal activities keep their column order (deterministic)
        perm = torch.sort(torch.diagonal(H), descending=True, stable=True).indices
        Hp = H[perm][:, perm]
    Uinv = _inverse_cholesky(Hp)
    W64 = torch.tensor(w, dtype=torch.float64, device=dev)
    best = None
    candidates = list(codec.gptq_grids(w, matmul))
    ratios = tuple(float(r) for r in cfg.clip_ratios if float(r) != 1.0)
    if ratios:  # int grids: the codec's scale and the clipped ones, judged on H (per row)
        clip = (lambda g: [g, *(_scaled(g, r) for r in ratios)]) if cfg.clip_after else \
            (lambda g: [_clip_before(w, g, ratios, H_true, W64)])
        candidates = [c for g in candidates for c in (clip(g) if _clippable(g) else [g])]
    if cfg.guard:
        candidates.append(None)  # None: the data-free codes
    for grid in candidates:
        if grid is None:
            grid, codes = codec.data_free_codes(w, matmul)
        else:
            codes = gptq_codes(w, Hp, grid, cfg, perm, Uinv)
        d = W64 - torch.tensor(values_of(codes, grid), dtype=torch.float64, device=dev)
        err = _weighted_error_t(d, H_true).cpu().numpy()
        if best is None:
            best = (err, codes, grid)
            continue
        take = err < best[0]
        if take.any():
            best = (np.where(take, err, best[0]), np.where(take[:, None], codes, best[1]),
                    _merge_grids(best[2], grid, take))
    return codec.encode(best[1], best[2], matmul)


def _merge_grids(a: Grid, b: Grid, take: np.ndarray) -> Grid:
    """Grid with rows of ``b`` where ``take`` and rows of ``a`` elsewhere (same kind and group)."""
    sb = None
    if a.scale_bytes is not None:
        sb = np.where(take[:, None], b.scale_bytes, a.scale_bytes)
    return Grid(np.where(take[:, None], b.scale, a.scale).astype(np.float32), a.group, a.kind, a.qmin, a.qmax, sb)


def _clippable(g: Grid) -> bool:
    """int grids of at most 4 bits: int8's step is so fine that a clip judged before GPTQ can lose
    after it (tests/test_gptq.py shows a case), and it has little rounding error to trade. Per channel
    only: a per-group scale must stay a float16 value (vLLM-Ascend rounds weight_scale x
    weight_scale_second to float16 at load), and r x s is not one."""
    return g.kind == "int" and g.qmax - g.qmin < 16 and g.scale.shape[1] == 1


def _scaled(g: Grid, r: float) -> Grid:
    """``g`` with every scale times r (an int grid: codes still clip(rint(w / s), qmin, qmax))."""
    return Grid((g.scale * np.float32(r)).astype(np.float32), g.group, g.kind, g.qmin, g.qmax, g.scale_bytes)


def _clip_before(w: np.ndarray, g: Grid, ratios, H, W64) -> Grid:
    """Per row, the scale among ``g``'s and r x it (r in ``ratios``) whose plain rounding has the
    smallest input-weighted error on H (ties keep the earlier, the unclipped first).  One float64
    [N, K] x [K, K] product per ratio: ~1.7 s each for a [3072, 3584] expert on one core."""
    best = None
    for grid in (g, *(_scaled(g, r) for r in ratios)):
        codes = np.clip(np.rint(w / grid.scale), grid.qmin, grid.qmax)  # per channel (_clippable): scale [N, 1]
        err = _weighted_error_t(W64 - _torch_like(values_of(codes, grid), W64), H).cpu().numpy()
        if best is None:
            best = (err, grid)
            continue
        take = err < best[0]
        best = (np.where(take, err, best[0]), _merge_grids(best[1], grid, take))
    return best[1]


def _torch_like(a: np.ndarray, ref):
    """numpy -> a float64 tensor on ``ref``'s device."""
    import torch

    return torch.tensor(a, dtype=torch.float64, device=ref.device)
