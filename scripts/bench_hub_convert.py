#!/usr/bin/env python
"""Convert-from-hub vs its two lower bounds: pure download and pure local conversion.

Serves a `synth --preset bench --num-experts N` checkpoint through a real olah mirror (offline) and measures,
in one run:
  (a) download: HubSource prefetch+fetch+release of every shard in order (scripts/bench_hub.bench_download),
      with the same window;
  (b) local: `kimi-quant convert <dir>` of the same checkpoint;
  (c) hub: `kimi-quant convert <org/name> --work-dir W --max-disk WINDOW` with HF_ENDPOINT at olah.
Streaming overlaps download and conversion, so (c) should be close to max(a, b): the ratio c / max(a, b) is
the figure of merit (target <= ~1.2). Also checks that (c)'s output is byte-identical to (b)'s (provenance and
journal aside) and that peak staging stayed within the window.

    python scripts/bench_hub_convert.py [--experts 2] [--shard-size 64MiB] [--window-shards 3] [--out-shard-size 32MiB]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_hub import bench_download, serve_checkpoint  # noqa: E402

SKIP = ("kimi_quant_journal.jsonl", "kimi_quant_provenance.json")


def snapshot(d: Path) -> dict[str, str]:
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and p.name not in SKIP:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            out[p.relative_to(d).as_posix()] = h.hexdigest()
    return out


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (the olah server)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


class CpuMeter:
    """CPU seconds of this process, its finished children and the olah server over a block."""

    def __init__(self, server_pid: int):
        self.pid = server_pid

    def _now(self) -> float:
        import resource

        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime + proc_cpu(self.pid)

    def __enter__(self):
        self.t0 = self._now()
        return self

    def __exit__(self, *exc):
        self.cpu = self._now() - self.t0


def run_cli(args: list[str], env: dict | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kimi_quant.cli", *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    dt = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"kimi-quant {' '.join(map(str, args))} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return dt, r.stdout


def main() -> None:
    from kimi_quant.cli import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=2, help="experts per MoE layer (2: ~0.6 GB, 4: ~0.84 GB)")
    ap.add_argument("--shard-size", default="64MiB", help="source shard size")
    ap.add_argument("--window-shards", type=float, default=3.0, help="--max-disk, in largest shards' worth")
    ap.add_argument("--target", default="a3")
    ap.add_argument("--out-shard-size", default="32MiB",
                    help="--max-shard-size for both conversions: several units, so shards can be released early")
    ap.add_argument("--workers", type=int, default=None, help="conversion workers (default: one per core)")
    ap.add_argument("--download-workers", type=int, default=2, help="HubSource download threads (its default)")
    ap.add_argument("--work", help="scratch directory (default: a temporary one, removed at the end)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.pop("HF_HUB_OFFLINE", None)

    tmp = Path(args.work or tempfile.mkdtemp(prefix="kq-bench-hubconv-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        from kimi_quant.synth import synth

        t = time.perf_counter()
        ck = synth("bench", tmp / "ckpt", num_experts=args.experts, shard_size=parse_size(args.shard_size))
        shards = sorted(ck.glob("*.safetensors"))
        total = sum(p.stat().st_size for p in shards)
        biggest = max(p.stat().st_size for p in shards)
        window = int(args.window_shards * biggest)
        server, repo_id = serve_checkpoint(ck, "bench-convert")
        print(f"checkpoint: {total / 1e6:.0f} MB in {len(shards)} shards (largest {biggest / 1e6:.0f} MB), served as "
              f"{repo_id} at {server.endpoint}; window {window / 1e6:.0f} MB; made in {time.perf_counter() - t:.1f}s",
              file=sys.stderr)
        env = {"HF_ENDPOINT": server.endpoint}
        common = ["-t", args.target, "--max-shard-size", args.out_shard_size] + (
            ["--workers", args.workers] if args.workers else [])

        # (a) pure download, same window, each shard released as soon as it is fetched
        os.environ["HF_ENDPOINT"] = server.endpoint
        meter = CpuMeter(server.proc.pid)
        with meter:
            dl = bench_download(server.endpoint, repo_id, tmp / "work-dl", workers=args.download_workers,
                                max_disk=window)
        cpu_a = meter.cpu
        a = dl["metadata_s"] + dl["download_s"]
        print(f"(a) download: {a:.2f}s ({dl['MB_per_s']} MB/s)", file=sys.stderr)

        # (b) pure local conversion
        with meter:
            b, _ = run_cli(["convert", ck, "-o", tmp / "out-local", "-q", *common])
        cpu_b = meter.cpu
        print(f"(b) local convert: {b:.2f}s", file=sys.stderr)

        # (c) convert from the hub with a bounded window
        with meter:
            c, out = run_cli(["convert", repo_id, "-o", tmp / "out-hub", "--work-dir", tmp / "work-hub",
                              "--max-disk", window, *common], env=env)
        cpu_c = meter.cpu
        m = re.search(r"^peak staging disk ([\d.]+) (MB|GB)$", out, re.M)
        peak = float(m.group(1)) * (1e6 if m.group(2) == "MB" else 1e9) if m else None
        print(f"(c) hub convert: {c:.2f}s; peak staging {peak / 1e6 if peak else float('nan'):.0f} MB "
              f"of a {window / 1e6:.0f} MB window", file=sys.stderr)

        identical = snapshot(tmp / "out-local") == snapshot(tmp / "out-hub")
        left = sorted(p.name for p in (tmp / "work-hub").glob("*.safetensors"))
        res = {"experts": args.experts, "target": args.target, "bytes": total, "shards": len(shards),
               "largest_shard": biggest, "window": window, "download_s": round(a, 2), "download_MB_per_s":
               dl["MB_per_s"], "local_convert_s": round(b, 2), "hub_convert_s": round(c, 2),
               "ratio_c_over_max_ab": round(c / max(a, b), 3),
               # a, b, c in CPU seconds (olah server included): on a box with few cores, download (olah and
               # sha256 are CPU-bound) and conversion compete, and c cannot drop below (cpu_a + cpu_b) / cores
               "cpu_s": {"a": round(cpu_a, 1), "b": round(cpu_b, 1), "c": round(cpu_c, 1)},
               "cpu_floor_s": round((cpu_a + cpu_b) / (os.cpu_count() or 1), 2),
               "ratio_c_over_max_ab_floor": round(c / max(a, b, (cpu_a + cpu_b) / (os.cpu_count() or 1)), 3),
               "load_avg_1m": round(os.getloadavg()[0], 2), "peak_staging": peak,
               "peak_within_window": peak is not None and peak <= window * 1.005,
               "download_peak_staged": dl["peak_staged_bytes"], "output_identical": identical,
               "staged_left": len(left), "cpus": os.cpu_count()}
        print(json.dumps(res))
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        if not identical:
            sys.exit("hub output differs from the local conversion")
    finally:
        if not args.work:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
