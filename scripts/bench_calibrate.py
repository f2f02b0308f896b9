#!/usr/bin/env python
"""How much faster is ``convert --calibrate`` with more local workers? (issue 30: 2 workers >= 1.7x 1.)

Writes the bench checkpoint (``synth --preset bench``: real expert shapes [3072, 3584], ``--experts`` routed
experts per layer, 3 layers), then converts it calibrated once per ``--workers`` count, in this one run, each
conversion a fresh ``kimi-quant convert`` process, and prints the wall time per count and the speed-up
over the first. The outputs must be byte-identical: the script checks it. The load average is printed
before and after: on a shared machine a ratio measured at a load above the core count says little.

    python scripts/bench_calibrate.py [--experts 32] [--workers 1,2] [--tokens 512] [--target a3] [--dir DIR]
                                      [--phases] [--repeat N] [--expert-tokens routed|all] [--executors local,ray]

``--executors local,ray``: each worker count on each executor (Ray: a local cluster the run starts; with more
tokens than one pass of 8192 its forward runs data-parallel in Ray actors), the same bytes required.

``--phases``: also where each run's time went (calibrate/phases.py: the driver's exclusive wall seconds in its
forward, Hessians, GPTQ (in the driver with 1 worker, else waiting for the workers), reads and writes;
``before`` is the process's start, imports and plan until the conversion began).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kimi_quant.synth import synth  # noqa: E402


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def output_digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.glob("quant_model_weights-*.safetensors")):
        h.update(p.name.encode())
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32, help="routed experts per MoE layer [32]")
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts to compare [1,2]")
    ap.add_argument("--tokens", type=int, default=512, help="calibration tokens [512]")
    ap.add_argument("--target", default="a3")
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoint and outputs go [a temp dir]")
    ap.add_argument("--phases", action="store_true", help="print where each run's time went")
    ap.add_argument("--repeat", type=int, default=1, help="runs per worker count, interleaved; the best counts [1]")
    ap.add_argument("--expert-tokens", default="routed", choices=("routed", "all"))
    ap.add_argument("--executors", default="local", help="comma-separated executors, local and/or ray [local]")
    args = ap.parse_args()
    counts = [(x, int(w)) for x in args.executors.split(",") for w in args.workers.split(",")]
    base = args.dir or Path(tempfile.mkdtemp(prefix="kq-bench-cal-"))
    src = bench_checkpoint(base, args.experts)
    print(f"checkpoint {src} ({sum(p.stat().st_size for p in src.iterdir()) / 1e9:.2f} GB, {args.experts} experts), "
          f"{args.tokens} tokens, target {args.target}, {os.cpu_count()} cores")
    print(f"load before: {load_average()}")
    rows = []
    for rep in range(args.repeat):
        for w in counts:
            row = _run(args, src, base, w)
            if isinstance(row, int):
                return row
            rows.append(row)
    print(f"load after: {load_average()}")
    best = {w: min(r[1] for r in rows if r[0] == w) for w in counts}
    w0 = counts[0]
    for w in counts[1:]:
        print(f"speed-up {_name(w)} over {_name(w0)}: {best[w0] / best[w]:.2f}x"
              + (f" (best of {args.repeat} each)" if args.repeat > 1 else ""))
    same = len({d for *_, d in rows}) == 1
    print("outputs byte-identical: " + ("yes" if same else "NO"))
    return 0 if same else 1


def bench_checkpoint(base: Path, experts: int) -> Path:
    """The bench checkpoint with ``experts`` routed experts per layer under ``base`` (written once)."""
    src = base / f"bench-{experts}"
    if not (src / "config.json").exists():
        synth("bench", src, num_experts=experts)
    return src


def convert_once(src: Path, out: Path, tokens: int, target: str, workers: int, expert_tokens: str = "routed",
                 phases: Path | None = None, extra: tuple[str, ...] = ()):
    """One calibrated ``kimi-quant convert`` in a fresh process: (wall s, driver CPU s, the finished process, its
    phases (calibrate/phases.py, ``before``: start-up until the conversion began) or None)."""
    shutil.rmtree(out, ignore_errors=True)  # a complete output would only be verified and kept
    cmd = [sys.executable, "-m", "kimi_quant.cli", "convert", str(src), "-t", target, "-o", str(out),
           "--calibrate", "--tokens", str(tokens), "--workers", str(workers), "--overwrite", "-q",
           "--expert-tokens", expert_tokens, *extra]
    if phases is not None:
        phases.unlink(missing_ok=True)
    env = {**os.environ, "KIMI_QUANT_CALIB_PHASES": str(phases)} if phases is not None else None
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # the converting process's own CPU (its workers are the fork server's children: not counted here)
    cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
    ph = None
    if phases is not None and phases.exists() and not r.returncode:
        ph = json.loads(phases.read_text())
        ph["before"] = round(wall - ph.pop("total"), 1)
    return wall, cpu, r, ph


def phases_line(ph: dict) -> str:
    return "  phases (s): " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in sorted(ph.items()))


def _name(run: tuple[str, int]) -> str:
    executor, w = run
    return f"{w} workers" + ("" if executor == "local" else f" on {executor}")


def _run(args, src: Path, base: Path, run: tuple[str, int]):
    """One conversion with ``run`` = (executor, workers): (run, wall s, digest), or its exit code when it failed."""
    executor, w = run
    out = base / f"out-{executor}-w{w}"
    wall, cpu, r, ph = convert_once(src, out, args.tokens, args.target, w, args.expert_tokens,
                                    base / f"phases-{executor}-w{w}.json" if args.phases else None,
                                    ("--executor", executor))
    if r.returncode:
        print(r.stderr, file=sys.stderr)
        return r.returncode
    print(f"{_name(run)}: wall {wall:.1f} s, driver CPU {cpu:.1f} s (load now {load_average()})", flush=True)
    if ph is not None:
        print(phases_line(ph), flush=True)
    return run, wall, output_digest(out)

if __name__ == "__main__":
    sys.exit(main())
