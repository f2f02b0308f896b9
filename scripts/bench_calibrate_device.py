#!/usr/bin/env python
"""How much faster is ``convert --calibrate --device cuda|npu`` than on the CPU? (issue 30, item 7.)

Converts the bench checkpoint (scripts/bench_calibrate.py's: ``synth --preset bench``, real expert shapes) calibrated
once on the CPU and once with ``--device DEVICE`` (the forward, the Hessians and GPTQ there), each a fresh
``kimi-quant convert`` process, and prints where each run's time went (calibrate/phases.py), the ratio CPU / device
per phase and in all, and how far the outputs' bytes differ (a device's kernels round differently: close, not
equal). On a machine where torch sees no such device it says so in one line and exits 0.

    python scripts/bench_calibrate_device.py [--device cuda] [--experts 32] [--tokens 512] [--target a3]
                                             [--workers 1[,N..]] [--cpu-workers N] [--dir DIR]

``--workers 1,4`` makes one device run per count (each worker process opens the device: GPTQ's CPU-side work
overlaps there); ``--cpu-workers N`` gives the CPU run its own count (e.g. one per core, as a CPU box would run
it), so the ratio reads as "this machine's CPU against its device"; by default the first of ``--workers``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_calibrate import bench_checkpoint, convert_once, load_average, phases_line  # noqa: E402


def device_seen(device: str) -> bool:
    import torch

    if device == "cpu":
        return True
    if device == "cuda":
        return torch.cuda.is_available()
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(torch.npu.is_available())


def pages_differing(a: Path, b: Path, page: int = 4096) -> tuple[int, int]:
    """(pages that differ, pages in all) over the two outputs' weight shards, paired by name."""
    differ = total = 0
    for pa in sorted(a.glob("quant_model_weights-*.safetensors")):
        x, y = pa.read_bytes(), (b / pa.name).read_bytes()
        n = max(len(x), len(y))
        total += -(-n // page)
        differ += sum(1 for i in range(0, n, page) if x[i:i + page] != y[i:i + page])
    return differ, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "npu", "cpu"),
                    help="the device to compare with the CPU [cuda]; cpu checks the script itself")
    ap.add_argument("--experts", type=int, default=32, help="routed experts per MoE layer [32]")
    ap.add_argument("--tokens", type=int, default=512, help="calibration tokens [512]")
    ap.add_argument("--target", default="a3")
    ap.add_argument("--workers", default="1", help="GPTQ workers of the device runs, comma-separated: one run per "
                    "count (each worker opens the device) [1]")
    ap.add_argument("--cpu-workers", type=int, default=None, help="GPTQ workers of the CPU run [the first of --workers]")
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoint and outputs go [a temp dir]")
    args = ap.parse_args()
    if not device_seen(args.device):
        print(f"no {args.device} device here (torch sees none): nothing measured")
        return 0
    counts = [int(w) for w in args.workers.split(",")]
    cpu_workers = args.cpu_workers or counts[0]
    base = args.dir or Path(tempfile.mkdtemp(prefix="kq-bench-caldev-"))
    src = bench_checkpoint(base, args.experts)
    print(f"checkpoint {src} ({args.experts} experts), {args.tokens} tokens, target {args.target}, "
          f"workers: CPU run {cpu_workers}, device runs {args.workers}; {os.cpu_count()} cores, device {args.device}")
    print(f"load before: {load_average()}")
    runs = []
    for device, workers in [("cpu", cpu_workers)] + [(args.device, w) for w in counts]:
        key = f"{device}-w{workers}"
        out = base / f"out-{key}"
        wall, _, r, ph = convert_once(src, out, args.tokens, args.target, workers,
                                      phases=base / f"phases-{key}.json", extra=("--device", device))
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return r.returncode
        print(f"{device}, {workers} workers: wall {wall:.1f} s (load now {load_average()})", flush=True)
        print(phases_line(ph), flush=True)
        runs.append((device, workers, wall, ph, out))
    print(f"load after: {load_average()}")
    _, _, cw, cph, cout = runs[0]
    for device, workers, dw, dph, dout in runs[1:]:
        ratios = {k: cph[k] / dph[k] for k in ("forward", "hessians", "gptq") if dph.get(k)}
        print(f"cpu ({cpu_workers} workers) / {device} ({workers} workers): wall {cw / dw:.2f}x; "
              + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        differ, total = pages_differing(cout, dout)
        print(f"  output shards: {differ} of {total} 4 KiB pages differ from the CPU run's"
              + (" (a device's kernels round differently: close, not equal; docs/calibration.md)" if differ else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
