"""Chunked vs token-by-token KDA on 2,048 tokens (fp32, CPU).

    python scripts/bench_kda.py [--tokens 2048] [--heads 4] [--head-dim 32] [--threads 2]

Prints both wall times, the speedup and the max abs difference. The chunked form must be >= 10x faster.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kimi_quant.runtime.kda import kda_chunked, kda_recurrent  # noqa: E402


def best_of(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    B, T, h, d = 1, a.tokens, a.heads, a.head_dim
    q = torch.nn.functional.normalize(torch.randn(B, T, h, d, generator=g), dim=-1) * d ** -0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, h, d, generator=g), dim=-1)
    v = torch.randn(B, T, h, d, generator=g)
    gg = -5.0 * torch.sigmoid(torch.randn(B, T, h, d, generator=g) - 3)
    beta = torch.sigmoid(torch.randn(B, T, h, generator=g))
    with torch.inference_mode():
        o1, _ = kda_recurrent(q, k, v, gg, beta)
        o2, _ = kda_chunked(q, k, v, gg, beta, chunk_size=a.chunk)
        t_loop = best_of(lambda: kda_recurrent(q, k, v, gg, beta), a.repeat)
        t_chunk = best_of(lambda: kda_chunked(q, k, v, gg, beta, chunk_size=a.chunk), a.repeat)
    print(f"KDA T={T} heads={h} head_dim={d} chunk={a.chunk} threads={a.threads}")
    print(f"recurrent {t_loop * 1e3:9.1f} ms")
    print(f"chunked   {t_chunk * 1e3:9.1f} ms")
    print(f"speedup   {t_loop / t_chunk:9.1f}x   max |diff| {(o1 - o2).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
