#!/usr/bin/env python
"""Cost and error of GPTQ's power-of-two scale candidates (``GPTQConfig.pow2_scales``) on a weight decoded from MXFP4.

One [N, K] matrix (default [3072, 3584], a routed expert) put on the MXFP4 grid with block exponents spread over
four octaves, H = (1/n) X^T X of synthetic inputs with a few loud channels.  W4A8_DYNAMIC per channel through
``gptq_quantize``: the clip search alone, with the power-of-two candidates screened like the clip ratios (the
default finalists), with every candidate judged exactly, and (MXFP4 weights) with H shrunk toward its diagonal,
coordinate descent after GPTQ and GPTQ on each row's two best scales (``hessian_shrink``, ``refine_passes``,
``gptq_finalists``).  One thread; CPU seconds of this process, the ratio to one same-thread [N, K] x [K, K]
float32 matmul, and the summed input-weighted error on H as given (the shrunk rows minimise another objective).
Also the cost of ``numerics.on_mxfp4_grid`` (how ``convert --calibrate`` decides to offer the candidates).

    python scripts/bench_gptq_pow2.py [--n 3072 --k 3584]
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse  # noqa: E402
from dataclasses import replace  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    import torch

    from kimi_quant.quant import get_codec
    from kimi_quant.quant import numerics as nm
    from kimi_quant.quant.gptq import MXFP4_CLIP_RATIOS, GPTQConfig, for_mxfp4_weights, gptq_quantize
    from kimi_quant.quant.gptq_judge import weighted_error

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--k", type=int, default=3584)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    N, K = args.n, args.k
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    w = 0.02 * rng.standard_normal((N, K)) * np.exp2(rng.integers(-3, 1, (N, K // 32))).repeat(32, axis=1)
    codes, scales = nm.mxfp4_ocp_quantize(w.astype(np.float32))
    w = nm.mx_dequantize(nm.e2m1_to_f32(codes), scales).astype(np.float32)
    x = rng.standard_normal((4 * K, K)).astype(np.float32)
    x[:, rng.integers(0, K, 6)] *= 20
    H = (x.T.astype(np.float64) @ x.astype(np.float64)) / len(x)
    del x
    codec = get_codec("W4A8_DYNAMIC")
    gptq_quantize(codec, w[:64], "gate", H, GPTQConfig())  # compiles the kernels and keeps H's factor
    A, B = torch.from_numpy(w), torch.from_numpy(H.astype(np.float32))

    def matmul_seconds():
        t = time.process_time()
        A @ B
        return time.process_time() - t

    mx = GPTQConfig(pow2_scales=True, clip_ratios=MXFP4_CLIP_RATIOS)
    configs = (("clip ratios only", GPTQConfig()), ("+ power-of-two, screened", GPTQConfig(pow2_scales=True)),
               ("+ power-of-two, all judged", GPTQConfig(pow2_scales=True, clip_finalists=8)),
               ("+ clips to 0.6 (MXFP4 weights)", mx),
               ("  + H shrunk (convert's setting)", for_mxfp4_weights(GPTQConfig())),
               ("  + descent, 1 pass", replace(mx, refine_passes=1)),
               ("  + descent, 2 passes", replace(mx, refine_passes=2)),
               ("  + GPTQ on 2 scales per row", replace(mx, gptq_finalists=2)),
               ("  + both (2 scales, 2 passes)", replace(mx, gptq_finalists=2, refine_passes=2)))
    for name, cfg in configs:
        best = None
        for _ in range(2):
            m = matmul_seconds()
            t = time.process_time()
            out = gptq_quantize(codec, w, "gate", H, cfg)
            g = time.process_time() - t
            best = (g, g / m) if best is None or g < best[0] else best
        err = weighted_error(w, codec.dequantize(out), H).sum()
        print(f"{name:32s} {best[0]:6.2f} CPU s  {best[1]:5.2f} x matmul  input-weighted error {err:.4e}")
    t = time.process_time()
    on = nm.on_mxfp4_grid(w)
    print(f"on_mxfp4_grid: {on} in {time.process_time() - t:.3f} CPU s")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
