"""How far `plan`'s wall-time estimate is from a measured conversion, for both targets, on the bundled
tiny model and a GB-sized bench checkpoint (issue targets: within 2x on the tiny model, within 25% at
GB size). Each row: plan's estimate, the measured wall of `convert` (best of --repeat runs, kernels
already built), and their ratio. Run it on a quiet machine: it prints the load average it saw.

    python scripts/bench_plan.py --work /tmp/kq-plan --experts 16 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "kimi_quant" / "model" / "fixtures" / "tiny"


def kq(*args) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "kimi_quant.cli", *map(str, args)], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"kimi-quant {' '.join(map(str, args))} failed: {r.stderr.strip()}")
    return r


def row(source: Path, target: str, work: Path, workers: int | None, repeat: int) -> dict:
    opts = ["--workers", str(workers)] if workers else []
    kq("plan", source, "-t", target, *opts, "--json", work / "plan.json")
    est = json.loads((work / "plan.json").read_text())["totals"]
    walls = []
    for _ in range(repeat):
        out = work / f"out-{target}"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        kq("convert", source, "-t", target, "-o", out, "-q", *opts)
        walls.append(time.perf_counter() - t0)
    best = min(walls)
    return {"source": source.name, "target": target, "in_bytes": est["in_bytes"], "estimate_s": est["wall_seconds"],
            "measured_s": round(best, 3), "ratio": round(est["wall_seconds"] / best, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/kq-bench-plan")
    ap.add_argument("--experts", type=int, default=16, help="routed experts of the bench checkpoint")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    bench = work / f"bench-{args.experts}"
    if not (bench / "config.json").exists():
        kq("synth", "--preset", "bench", "--num-experts", args.experts, "-o", bench, "--overwrite")
    kq("convert", TINY, "-t", "a3", "-o", work / "warm", "-q")  # the kernels are built before anything is timed
    rows = [row(src, t, work, args.workers, args.repeat) for src in (TINY, bench) for t in ("a3", "950dt")]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, workers {args.workers or 'default'}")
    print(f"{'source':12s} {'target':6s} {'input':>9s} {'plan':>8s} {'measured':>9s} {'plan/measured':>14s}")
    for r in rows:
        print(f"{r['source']:12s} {r['target']:6s} {r['in_bytes'] / 1e9:8.3f}G {r['estimate_s']:7.2f}s "
              f"{r['measured_s']:8.2f}s {r['ratio']:14.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
