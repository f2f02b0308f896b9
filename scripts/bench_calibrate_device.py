#!/usr/bin/env python
"""How much faster is ``convert --calibrate --device cuda|npu`` than on the CPU? (issue 30, item 7.)

Converts the bench checkpoint (scripts/bench_calibrate.py's: ``synth --preset bench``, real expert shapes) calibrated
once on the CPU and once with ``--device DEVICE`` (the forward, the Hessians and GPTQ there), each a fresh
``kimi-quant convert`` process, and prints where each run's time went (calibrate/phases.py), the ratio CPU / device
per phase and in all, and how far the outputs' bytes differ (a device's kernels round differently: close, not
equal). On a machine where torch sees no such device it says so in one line and exits 0.

    python scripts/bench_calibrate_device.py [--device cuda] [--experts 32] [--tokens 512] [--target a3]
                                             [--workers 1] [--dir DIR]
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
    ap.add_argument("--workers", type=int, default=1, help="GPTQ workers of both runs [1]")
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoint and outputs go [a temp dir]")
    args = ap.parse_args()
    if not device_seen(args.device):
        print(f"no {args.device} device here (torch sees none): nothing measured")
        return 0
    base = args.dir or Path(tempfile.mkdtemp(prefix="kq-bench-caldev-"))
    src = bench_checkpoint(base, args.experts)
    print(f"checkpoint {src} ({args.experts} experts), {args.tokens} tokens, target {args.target}, "
          f"{args.workers} workers, {os.cpu_count()} cores, device {args.device}")
    print(f"load before: {load_average()}")
    runs = {}
    for key, device in (("cpu", "cpu"), ("device", args.device)):
        out = base / f"out-{key}"
        wall, _, r, ph = convert_once(src, out, args.tokens, args.target, args.workers,
                                      phases=base / f"phases-{key}.json", extra=("--device", device))
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return r.returncode
        print(f"{device}: wall {wall:.1f} s (load now {load_average()})", flush=True)
        print(phases_line(ph), flush=True)
        runs[key] = (wall, ph, out)
    print(f"load after: {load_average()}")
    (cw, cph, cout), (dw, dph, dout) = runs["cpu"], runs["device"]
    ratios = {k: cph[k] / dph[k] for k in ("forward", "hessians", "gptq") if dph.get(k)}
    print(f"cpu / {args.device}: wall {cw / dw:.2f}x; " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    differ, total = pages_differing(cout, dout)
    print(f"output shards: {differ} of {total} 4 KiB pages differ from the CPU run's"
          + (" (a device's kernels round differently: close, not equal; docs/calibration.md)" if differ else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
