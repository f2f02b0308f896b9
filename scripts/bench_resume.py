#!/usr/bin/env python
"""Resume cost: clean conversion vs. kill at ~50% (by journal lines) + resume.

    python scripts/bench_resume.py [--work /tmp/kq_bench] [--num-experts 2] [--target 950dt] [--kill-at 0.5]

Writes a multi-hundred-MB synthetic K3.1-shaped checkpoint (``synth --preset bench``) once, times an
uninterrupted conversion, then starts the same conversion again, SIGKILLs its whole process group once
the journal holds ``kill-at`` x (number of output shards) unit lines, re-runs the same command and
times the resume. Prints resumed-time / clean-time against the unfinished fraction (by shards and by
output bytes), and checks that the resumed output equals the clean one byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

JOURNAL = "kimi_quant_journal.jsonl"


def cmd(*args) -> list[str]:
    return [sys.executable, "-m", "kimi_quant.cli", *map(str, args)]


def units(out: Path) -> dict[str, int]:
    done = {}
    p = out / JOURNAL
    if not p.exists():
        return done
    for line in p.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if ev.get("kind") == "unit":
            done[ev["file"]] = ev["size"]
    return done


def _nbytes(t: dict) -> int:
    from kimi_quant.dtypes import nbytes

    return nbytes(t["dtype"], t["shape"])


def snapshot(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name != JOURNAL}


def timed(args) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"failed: {' '.join(map(str, args))}\n{r.stderr}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/kq_bench_resume", type=Path)
    ap.add_argument("--num-experts", type=int, default=2, help="bench preset experts per layer (2: ~570 MB)")
    ap.add_argument("--target", default="950dt")
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of output shards journaled at the kill")
    ap.add_argument("--max-shard-size", default="24MiB")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--override", action="append", default=[], help="passed to convert (e.g. '*=FLOAT')")
    a = ap.parse_args()

    src, clean, resumed = a.work / "src", a.work / "clean", a.work / "resumed"
    a.work.mkdir(parents=True, exist_ok=True)
    if not (src / "config.json").exists():
        print(f"synth bench ({a.num_experts} experts) -> {src}", flush=True)
        subprocess.run(cmd("synth", "--preset", "bench", "--num-experts", a.num_experts, "-o", src,
                           "--shard-size", "128MiB"), check=True, capture_output=True)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    conv = ["convert", src, "-t", a.target, "--max-shard-size", a.max_shard_size, "-q"]
    conv += [x for o in a.override for x in ("--override", o)]
    if a.workers:
        conv += ["--workers", a.workers]

    for d in (clean, resumed):
        shutil.rmtree(d, ignore_errors=True)
    t_clean = timed(cmd(*conv, "-o", clean))
    total = units(clean)
    n_total, b_total = len(total), sum(total.values())
    print(f"source {size / 1e6:.0f} MB -> {n_total} output shards, {b_total / 1e6:.0f} MB; clean run {t_clean:.2f} s",
          flush=True)

    plan_json = a.work / "plan.json"
    plan_args = ["plan", src, "-t", a.target, "--max-shard-size", a.max_shard_size, "--no-shards", "--json", plan_json]
    plan_args += [x for o in a.override for x in ("--override", o)]
    subprocess.run(cmd(*plan_args), check=True, capture_output=True)
    in_bytes = {u["file"]: sum(_nbytes(t) for t in u["tensors"]) for u in json.loads(plan_json.read_text())["units"]}
    t_noop = timed(cmd(*conv, "-o", clean))  # fixed cost: startup, plan, re-hash of every kept shard

    want = max(1, round(a.kill_at * n_total))
    p = subprocess.Popen(cmd(*conv, "-o", resumed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    t0 = time.perf_counter()
    while p.poll() is None and len(units(resumed)) < want:
        time.sleep(0.01)
    if p.poll() is not None:
        sys.exit("the run finished before the kill point; use a bigger --num-experts")
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    t_killed = time.perf_counter() - t0
    done = units(resumed)
    n_left = n_total - len(done)
    b_left = b_total - sum(done.values())
    t_resume = timed(cmd(*conv, "-o", resumed))
    same = snapshot(resumed) == snapshot(clean)

    frac_units, frac_bytes = n_left / n_total, b_left / b_total
    frac_in = sum(v for f, v in in_bytes.items() if f not in done) / sum(in_bytes.values())
    ratio = t_resume / t_clean
    print(f"killed after {t_killed:.2f} s with {len(done)}/{n_total} shards journaled")
    print(f"unfinished: {frac_units:.1%} of shards, {frac_bytes:.1%} of output bytes, {frac_in:.1%} of input bytes")
    print(f"resume {t_resume:.2f} s / clean {t_clean:.2f} s = {ratio:.2f} vs unfinished fraction {frac_in:.2f} "
          f"(input bytes); re-run of the complete output (fixed cost: startup, plan, re-hash) {t_noop:.2f} s")
    if t_clean > t_noop:
        print(f"excluding the fixed cost: (resume - fixed) / (clean - fixed) = "
              f"{(t_resume - t_noop) / (t_clean - t_noop):.2f}")
    print(f"resumed output byte-identical to the clean run: {'yes' if same else 'NO'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
