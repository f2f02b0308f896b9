#!/usr/bin/env python
"""Throughput and quality of the quantization codecs on one [N, K] bf16 matrix (default [3072, 3584]).

Prints, per scheme: GB/s of bf16 input for the numba fast path (``quantize_bf16``) and for the numpy
reference (``quantize``), the numpy memcpy GB/s of the same bytes as a baseline, and the quality
lever: the relative squared error of the chosen rule vs the naive rule (absmax round-to-nearest for
int4, the OCP floor rule for MX), i.e. SSE(chosen) / SSE(naive).  Single thread; times are thread CPU time (best of --repeat).

    python scripts/bench_codecs.py [--n 3072 --k 3584 --dist gauss|t4 --repeat 3 --no-ref]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kimi_quant.dtypes import bf16_to_f32, f32_to_bf16
from kimi_quant.quant import get_codec
from kimi_quant.quant import kernels, numerics as nm


def best_time(fn, repeat):
    """Best of ``repeat`` runs, in CPU seconds of this thread (robust on a loaded machine)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best


def naive(name, w):
    """Dequantized weight under the naive rule."""
    if name == "W4A8_DYNAMIC":
        q, s = nm.int4_absmax_quantize(w)
        return q * s[:, None]
    if name == "W4A8_MXFP":
        c, sc = nm.mxfp4_ocp_quantize(w)
        return nm.mx_dequantize(nm.e2m1_to_f32(c), sc)
    if name == "W8A8_MXFP8":
        c, sc = nm.mxfp8_ocp_quantize(w)
        return nm.mx_dequantize(nm.e4m3_to_f32(c), sc)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--dist", default="gauss", choices=["gauss", "t4"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-ref", action="store_true", help="skip the (slow) numpy reference timing")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.n, args.k)) if args.dist == "gauss" else rng.standard_t(4, (args.n, args.k))
    w_u16 = f32_to_bf16((0.02 * x).astype(np.float32))
    w = bf16_to_f32(w_u16)
    nbytes = w_u16.nbytes
    gb = nbytes / 1e9

    t = time.perf_counter()
    kernels.warmup()
    print(f"kernel warm-up (compile or cache load): {time.perf_counter() - t:.2f} s")
    dst = np.empty_like(w_u16)
    t_copy = best_time(lambda: np.copyto(dst, w_u16), 5)
    print(f"matrix [{args.n}, {args.k}] bf16 = {nbytes / 2**20:.1f} MiB, dist={args.dist}; memcpy {gb / t_copy:.2f} GB/s")
    print(f"{'scheme':<14}{'fast GB/s':>10}{'ref GB/s':>10}{'fast/memcpy':>13}{'rel.err':>10}{'SSE/naive':>11}  bit-identical")
    for name, mm in [("W4A8_DYNAMIC", "down"), ("W8A8_DYNAMIC", None), ("W4A8_MXFP", None), ("W8A8_MXFP8", None)]:
        codec = get_codec(name)
        out = codec.alloc(w_u16.shape, mm)
        t_fast = best_time(lambda: codec.quantize_bf16(w_u16, mm, out=out), args.repeat)
        fast = codec.quantize_bf16(w_u16, mm)
        if args.no_ref:
            ref_s, same = "-", "-"
        else:
            t = time.thread_time()
            ref = codec.quantize(w, mm)
            ref_s = f"{gb / (time.thread_time() - t):.3f}"
            same = all(np.array_equal(fast[k].view(np.uint8), ref[k].view(np.uint8)) for k in fast)
        deq = codec.dequantize(fast)
        sse = float(((w.astype(np.float64) - deq) ** 2).sum())
        rel = np.sqrt(sse / float((w.astype(np.float64) ** 2).sum()))
        nv = naive(name, w)
        ratio = "-" if nv is None else f"{sse / float(((w.astype(np.float64) - nv) ** 2).sum()):.4f}"
        print(f"{name:<14}{gb / t_fast:>10.3f}{ref_s:>10}{t_copy / t_fast:>13.4f}{rel:>10.4f}{ratio:>11}  {same}")


if __name__ == "__main__":
    main()
