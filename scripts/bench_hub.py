#!/usr/bin/env python
"""Measure pure download time of a generated multi-hundred-MB checkpoint repo served by a real olah mirror.

    python scripts/bench_hub.py [--mb 400] [--shards 4] [--workers 1 2] [--max-disk-shards 2]

Reusable pieces for the converter bench:
  * ``serve_checkpoint(src_dir)`` -> (server, repo_id): serve an existing local checkpoint through olah
    (LFS pointers + objects), so ``convert --source <repo_id>`` can run against HF_ENDPOINT=server.endpoint;
  * ``bench_download(endpoint, repo_id, work_dir, ...)`` -> dict: HubSource prefetch+fetch+release of every
    shard in order, with wall time, MB/s and peak staged bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def serve_checkpoint(src_dir: str | Path, name: str = "bench"):
    """Start (or reuse) the session's olah and commit ``src_dir`` to a new repo; returns (server, repo_id)."""
    from hubtools.olah_harness import shared_olah

    server = shared_olah()
    repo = server.new_repo(name)
    src_dir = Path(src_dir)
    files = {p.relative_to(src_dir).as_posix(): p for p in sorted(src_dir.rglob("*")) if p.is_file()}
    repo.commit(files, message="bench checkpoint")
    return server, repo.repo_id


def make_checkpoint(dst: Path, total_mb: int, shards: int) -> Path:
    """A safetensors checkpoint of ``shards`` files totalling about ``total_mb`` MB (random BF16 bits)."""
    import numpy as np
    from safetensors.numpy import save_file

    dst.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per = total_mb * 1_000_000 // shards
    rows = 4096
    cols = max(1, per // (rows * 2 * 4))
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {f"model.layers.{s}.w{t}.weight": rng.integers(0, 65535, (rows, cols), dtype=np.uint16)
                   .view(np.float16) for t in range(4)}
        save_file(tensors, str(dst / name))
        weight_map.update({k: name for k in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "config.json").write_text("{}")
    return dst


def bench_download(endpoint: str, repo_id: str, work_dir: str | Path, workers: int = 2,
                   max_disk: int | None = None, lookahead: int | None = None) -> dict:
    from kimi_quant.source.hub import HubSource

    t0 = time.perf_counter()
    src = HubSource(repo_id, endpoint=endpoint, work_dir=work_dir, workers=workers, max_disk=max_disk,
                    lookahead=lookahead)
    shards = sorted(set(src.weight_map().values()))
    total = sum(src.entry(s).size for s in shards)
    t1 = time.perf_counter()
    src.prefetch(shards)
    try:
        for s in shards:
            src.fetch(s)
            src.release(s)
    finally:
        src.close()
    t2 = time.perf_counter()
    return {"repo": repo_id, "shards": len(shards), "bytes": total, "workers": workers,
            "metadata_s": round(t1 - t0, 3), "download_s": round(t2 - t1, 3),
            "MB_per_s": round(total / 1e6 / (t2 - t1), 1), "peak_staged_bytes": src.peak_staged_bytes,
            "max_disk": max_disk, "lookahead": lookahead}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=400)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--max-disk-shards", type=float, default=2.0, help="window, in shards' worth of bytes")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    tmp = Path(tempfile.mkdtemp(prefix="kq-bench-hub-"))
    try:
        t = time.perf_counter()
        ck = make_checkpoint(tmp / "ckpt", args.mb, args.shards)
        server, repo_id = serve_checkpoint(ck)
        print(f"generated and served {args.mb} MB in {args.shards} shards in {time.perf_counter() - t:.1f}s "
              f"({server.endpoint})", file=sys.stderr)
        shard_size = max(p.stat().st_size for p in ck.glob("*.safetensors"))
        for w in args.workers:
            res = bench_download(server.endpoint, repo_id, tmp / f"work-{w}", workers=w,
                                 max_disk=int(args.max_disk_shards * shard_size))
            print(json.dumps(res))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
