#!/usr/bin/env python
"""Benchmark whole-CLI conversion against reading the same bytes, with peak memory.

For each target it runs `kimi-quant convert` as a subprocess on a `synth --preset bench`
checkpoint and reports, measured in the same run:
  * GB/s of BF16 input, and the ratio to a plain read of the same source bytes;
  * peak RSS of the whole process tree (driver + workers, sampled every 20 ms) and of the largest process;
  * cores busy: CPU seconds of the whole process tree over the wall time (and the load average, since
    other work on the machine skews every number here);
  * with --double, the same on a checkpoint with twice the experts (memory must stay flat).
Optionally (--llm-compressor) runs llm-compressor's model_free_ptq on the same checkpoint when installed.

    python scripts/bench_convert.py --work /tmp/kq-bench --out /dev/shm/kq-bench [--experts 16] [--double]
        [--targets a3 950dt] [--max-shard-size 4GiB 128MiB] [--workers 1 2]
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


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def tree_pids(pid: int) -> list[int]:
    pids, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        pids.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                frontier += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return pids


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process so far (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def tree_rss(pids: list[int]) -> tuple[int, int]:
    """(sum, max) RSS in bytes over ``pids``."""
    total = biggest = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        kb = int(line.split()[1]) * 1024
                        total += kb
                        biggest = max(biggest, kb)
        except OSError:
            pass
    return total, biggest


def run_measured(cmd: list[str]) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak_sum = peak_max = 0
    cpu: dict[int, float] = {}  # pid -> CPU seconds when last seen (a worker's last 20 ms are missed)
    while proc.poll() is None:
        pids = tree_pids(proc.pid)
        s, m = tree_rss(pids)
        peak_sum, peak_max = max(peak_sum, s), max(peak_max, m)
        for p in pids:
            c = cpu_seconds(p)
            if c is not None:
                cpu[p] = c
        time.sleep(0.02)
    seconds = time.perf_counter() - t0
    out = proc.stdout.read()
    if proc.returncode:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{out}")
    return {"seconds": seconds, "peak_rss_tree": peak_sum, "peak_rss_max": peak_max, "log": out,
            "cores_busy": sum(cpu.values()) / seconds}


def read_gbps(src: Path) -> tuple[float, int]:
    """Throughput of reading every source shard byte (page cache as the conversion will see it)."""
    files = sorted(src.glob("*.safetensors"))
    buf = bytearray(64 << 20)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total / (time.perf_counter() - t0) / 1e9, total


def synth(work: Path, experts: int) -> Path:
    src = work / f"bench-bf16-e{experts}"
    if not (src / "config.json").exists():
        subprocess.run(["kimi-quant", "synth", "--preset", "bench", "--num-experts", str(experts), "-o", str(src)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return src


def bench(src: Path, work: Path, targets: list[str], workers: int | None, shard: str,
          extra: list[str] = (), repeat: int = 1) -> list[dict]:
    """Convert ``src`` for each target into ``work`` (put it on tmpfs to measure compute, not the disk),
    ``repeat`` times each: GB/s of the median run, and of the best."""
    rows = []
    read_bw, nbytes = read_gbps(src)
    read_bw = max(read_bw, read_gbps(src)[0])  # best of two warm reads
    for target in targets:
        out = work / f"out-{src.name}-{target}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = ["kimi-quant", "convert", str(src), "-t", target, "-o", str(out), "--max-shard-size", shard, "--quiet"]
        if workers:
            cmd += ["--workers", str(workers)]
        cmd += list(extra)
        runs = []
        for _ in range(repeat):
            shutil.rmtree(out, ignore_errors=True)
            runs.append(run_measured(cmd))
        shutil.rmtree(out, ignore_errors=True)
        runs.sort(key=lambda r: r["seconds"])
        secs = [r["seconds"] for r in runs]
        median, best = secs[len(secs) // 2], secs[0]
        gbps = nbytes / median / 1e9
        rows.append({"source": src.name, "target": target, "shard": shard, "workers": workers,
                     "options": " ".join(extra), "in_gb": nbytes / 1e9,
                     "runs": repeat, "seconds": round(median, 2), "gbps": round(gbps, 3),
                     "gbps_best": round(nbytes / best / 1e9, 3), "read_gbps": round(read_bw, 2),
                     "ratio_to_read": round(gbps / read_bw, 3),
                     "cores_busy": round(runs[len(runs) // 2]["cores_busy"], 2),
                     "loadavg_1m": round(os.getloadavg()[0], 2),
                     "peak_rss_tree_mb": max(r["peak_rss_tree"] for r in runs) >> 20,
                     "peak_rss_max_mb": max(r["peak_rss_max"] for r in runs) >> 20})
    return rows


def bench_llm_compressor(src: Path, work: Path, python: str) -> list[dict]:
    """llm-compressor's model-free path on the same checkpoint (run by ``python``, e.g. its own venv)."""
    if subprocess.run([python, "-c", "import llmcompressor"], capture_output=True).returncode:
        print(f"llm-compressor not importable by {python}: skipping the side-by-side", file=sys.stderr)
        return []
    rows = []
    code = ("import sys; from llmcompressor import model_free_ptq; "
            "model_free_ptq(sys.argv[1], sys.argv[2], scheme=sys.argv[3], ignore=['re:.*norm.*','re:.*lm_head.*','re:.*embed.*','re:.*conv1d.*','re:.*A_log','re:.*dt_bias','re:.*e_score_correction_bias','re:.*vision_tower.*','re:.*mm_projector.*','re:.*res_proj.*','re:.*\\.gate\\.weight'], device='cpu')")
    for scheme in ("W4A8", "MXFP4"):
        out = work / f"llmc-{scheme}"
        shutil.rmtree(out, ignore_errors=True)
        r = run_measured([python, "-c", code, str(src), str(out), scheme])
        nbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        shutil.rmtree(out, ignore_errors=True)  # a few GB: on tmpfs it would squeeze the page cache
        rows.append({"tool": "llm-compressor", "scheme": scheme, "seconds": round(r["seconds"], 2),
                     "gbps": round(nbytes / r["seconds"] / 1e9, 3), "peak_rss_tree_mb": r["peak_rss_tree"] >> 20})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/kq-bench", help="where the synthetic source lives")
    ap.add_argument("--out", default=None, help="where outputs go (default: --work; /dev/shm measures compute, not disk)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--double", action="store_true", help="also run with twice the experts (flat-memory check)")
    ap.add_argument("--targets", nargs="+", default=["a3", "950dt"])
    ap.add_argument("--workers", type=int, nargs="+", default=[None],
                    help="worker counts to run (e.g. 1 2: how conversion scales; default: one per core)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per target: the median is reported (and the best)")
    ap.add_argument("--max-shard-size", nargs="+", default=["128MiB"],
                    help="output shard sizes to run (e.g. 4GiB 128MiB: the default and a small one)")
    ap.add_argument("--llm-compressor", action="store_true", help="also run llm-compressor model_free_ptq")
    ap.add_argument("--llm-compressor-python", default=sys.executable,
                    help="interpreter that has llmcompressor installed (keep it out of this venv)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--also-hash-inputs", action="store_true",
                    help="repeat each conversion with --hash-inputs (sha256 of every local source shard)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or args.work)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shard in args.max_shard_size:
        for workers in args.workers:
            rows += bench(synth(work, args.experts), out, args.targets, workers, shard, repeat=args.repeat)
            if args.also_hash_inputs:
                rows += bench(synth(work, args.experts), out, args.targets, workers, shard,
                              ["--hash-inputs"], repeat=args.repeat)
            if args.double:
                rows += bench(synth(work, 2 * args.experts), out, args.targets, workers, shard, repeat=args.repeat)
    if args.llm_compressor:
        rows += bench_llm_compressor(synth(work, args.experts), out, args.llm_compressor_python)
    print(f"cores: {os.cpu_count()}")
    for r in rows:
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
