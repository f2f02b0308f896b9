#!/usr/bin/env python
"""Cost of the calibrated (GPTQ) path per expert-sized matrix (default [3072, 3584]) on one core.

Prints, per scheme, the CPU seconds (process time: robust on a shared machine; with one torch
thread it is the single-core cost) of one ``codec.quantize(w, matmul, hessian=H, gptq=cfg)`` with the
guard (default config) and without it, next to the data-free fast path (``quantize_bf16``) on the
same matrix, all in one run.  torch runs on one thread (``torch.set_num_threads(1)``): the converter
runs one process per core.  H is (1/n) X^T X of n synthetic correlated inputs (the cost does not
depend on the values).

    python scripts/bench_gptq.py [--n 3072 --k 3584 --schemes W4A8_DYNAMIC,W4A8_MXFP --threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kimi_quant.dtypes import bf16_to_f32, f32_to_bf16  # noqa: E402
from kimi_quant.quant import get_codec, warmup  # noqa: E402
from kimi_quant.quant import gptq  # noqa: E402
from kimi_quant.quant.gptq import GPTQConfig  # noqa: E402

ROLES = {"W4A8_DYNAMIC": "down", "W8A8_DYNAMIC": None, "W4A8_MXFP": None, "W8A8_MXFP8": None}


def main():
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--schemes", default="W4A8_DYNAMIC,W4A8_MXFP,W8A8_DYNAMIC,W8A8_MXFP8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    w_u16 = f32_to_bf16((0.02 * rng.standard_normal((args.n, args.k))).astype(np.float32))
    w = bf16_to_f32(w_u16)
    x = rng.standard_normal((4096, args.k)).astype(np.float32)
    x[:, rng.integers(0, args.k, 16)] *= 20
    H = (x.T.astype(np.float64) @ x) / x.shape[0]
    warmup()
    cfg = GPTQConfig(device=args.device)
    print(f"matrix [{args.n}, {args.k}], torch threads {torch.get_num_threads()}, device {args.device}")
    print(f"{'scheme':<14}{'data-free s':>12}{'GPTQ s':>10}{'GPTQ no guard s':>17}{'no act-order s':>16}"
          f"{'no clip search s':>18}")
    for name in args.schemes.split(","):
        codec = get_codec(name)
        mm = ROLES[name]
        t = time.process_time()
        codec.quantize_bf16(w_u16, mm)
        t_free = time.process_time() - t
        times = []
        for c in (cfg, replace(cfg, guard=False), replace(cfg, guard=False, act_order=False),
                  replace(cfg, clip_ratios=())):
            gptq._LAST_FACTOR.clear()  # each call pays its own H^-1 factor (the kept one is for q/k/v sharing one H)
            t = time.process_time()
            codec.quantize(w, mm, hessian=H, gptq=c)
            times.append(time.process_time() - t)
        print(f"{name:<14}{t_free:>12.2f}{times[0]:>10.2f}{times[1]:>17.2f}{times[2]:>16.2f}{times[3]:>18.2f}", flush=True)


if __name__ == "__main__":
    main()
