"""``plan --calibrate``'s wall time and memory against a measured ``convert --calibrate`` of the same source.

Writes the source (``--preset bench``: real expert shapes; or pass ``--source DIR``), asks the estimate
for ``--workers``/``--executor``, runs the calibrated convert in a subprocess and reports both wall
times, the ratio (target: within 25% on the bench checkpoint) and the convert's peak resident set
beside the estimated peak on this machine. Run it on a quiet machine; it prints the load average
before and after. Exit 1 when the ratio is outside ``--tolerance``.

    python scripts/check_calibrate_estimate.py                      # bench, a3, 8192 tokens, 1 worker
    python scripts/check_calibrate_estimate.py --workers 2 --tokens 2048
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", help="a checkpoint directory (default: synth --preset bench into a temp dir)")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--target", default="a3")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--executor", default="local", choices=("local", "ray"))
    ap.add_argument("--tolerance", type=float, default=0.25)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from kimi_quant.calibrate import CalibConfig
    from kimi_quant.calibrate.estimate import estimate
    from kimi_quant.convert import build_plan
    from kimi_quant.model.spec import load_model_spec_from_source
    from kimi_quant.source import open_source
    from kimi_quant.synth import synth

    print(f"load average before: {os.getloadavg()}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="kq-check-cal-") as tmp:
        src_dir = Path(args.source) if args.source else synth(args.preset, Path(tmp) / args.preset)
        src = open_source(str(src_dir))
        try:
            plan = build_plan(src, args.target, None, (), 4 * 1024**3, 0, calibrated=True)
            spec = load_model_spec_from_source(src, recipe_given=True)
        finally:
            src.close()
        e = estimate(plan, spec, CalibConfig(tokens=args.tokens), args.workers, args.executor)
        cmd = [sys.executable, "-m", "kimi_quant.cli", "convert", str(src_dir), "-t", args.target, "-o",
               str(Path(tmp) / "out"), "--calibrate", "--tokens", str(args.tokens), "--workers", str(args.workers),
               "--executor", args.executor, "-q"]
        t = time.perf_counter()
        r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)})
        measured = time.perf_counter() - t
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        rss, cpu = usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime
    print(f"load average after: {os.getloadavg()}")
    if r.returncode:
        print(f"convert failed (exit {r.returncode}): {' '.join(cmd)}")
        return 2
    ratio = e["wall_seconds"] / measured
    print(f"{args.preset or args.source} -> {args.target}, {args.tokens} tokens, {args.workers} {args.executor} workers")
    print(f"  wall: estimated {e['wall_seconds']:.1f} s (start-up {e['startup_s']:.1f}, forward {e['forward_s']:.1f}, "
          f"Hessians {e['hessian_s']:.1f}, GPTQ {e['gptq_s']:.1f}), measured {measured:.1f} s: ratio {ratio:.2f} "
          f"(the convert's CPU time {cpu:.1f} s: with 1 worker on a loaded machine, the closer proxy)")
    print(f"  memory: estimated peak here {e['memory_bytes'] / 1e9:.2f} GB (driver {e['driver_memory_bytes'] / 1e9:.2f}, "
          f"worker {e['worker_memory_bytes'] / 1e9:.2f}), measured max RSS of one process {rss / 1e9:.2f} GB")
    return 0 if abs(ratio - 1) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
