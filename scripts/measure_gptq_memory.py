"""Peak resident memory of one GPTQ job, measured, beside the formula ``plan --calibrate`` uses.

Each size runs in a fresh subprocess (one thread): the process imports what a worker imports, warms the
GPTQ kernels on a small matrix, records its resident set (the base), builds a float32 [N, K] weight and
the Hessian as the collector hands it over (``HessianCollector``: float64 up to FLOAT64_MAX_K, float32
above, its own sum), resets the high-water mark, then runs ``gptq_quantize``: the peak is VmHWM after it.
Printed per size: the measured peak, ``calibrate.estimate.worker_bytes`` (the formula, which uses the
constant ``WORKER_BASE_BYTES`` for the base) and their ratio; exit 1 if the formula is ever below the
measurement. K3.1 Pro's layer-0 dense down projection is [7168, 33792]; ``--full`` measures it too
(~13 GB).

    python scripts/measure_gptq_memory.py     # [1024, 4096] .. [2048, 16384]
    python scripts/measure_gptq_memory.py --sizes 3072x3584 7168x33792
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys
import numpy as np, torch
torch.set_num_threads(1)

def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'):
            return int(line.split()[1]) * 1024

def reset():
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')

from kimi_quant.quant import get_codec
from kimi_quant.quant.gptq import gptq_quantize
from kimi_quant.calibrate.hessian import HessianCollector
N, K, scheme, matmul = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] or None
codec = get_codec(scheme)
rng = np.random.default_rng(0)
gptq_quantize(codec, (rng.standard_normal((64, 128)) * 0.02).astype(np.float32), matmul,
              np.eye(128) + 0.1)  # kernels loaded: part of the base
import gc; gc.collect(); reset()
base = hwm()
coll = HessianCollector()
coll.want(['x'])
x = torch.from_numpy(rng.standard_normal((max(256, K // 8), K)).astype(np.float32))
coll('x', x)
del x
H = coll.hessian('x')
w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
gc.collect(); reset()  # the collection's own transients are the driver's, not the job's
inputs = hwm()
gptq_quantize(codec, w, matmul, H)
print(json.dumps({"base": base, "inputs": inputs, "peak": hwm()}))
"""


def measure(N: int, K: int, scheme: str, matmul: str | None) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(N), str(K), scheme, matmul or ""],
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"[{N}, {K}]: the child failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="*", default=["1024x4096", "1024x8192", "2048x12288", "2048x16384"])
    ap.add_argument("--full", action="store_true", help="also [7168, 33792] (K3.1 Pro's dense down projection)")
    ap.add_argument("--scheme", default="W8A8_DYNAMIC")
    args = ap.parse_args()
    from kimi_quant.calibrate.estimate import WORKER_BASE_BYTES, worker_bytes

    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes] + ([(7168, 33792)] if args.full else [])
    bad = 0
    print(f"{'N x K':>14s} {'base':>8s} {'peak':>9s} {'formula':>9s} {'formula/peak':>12s}  (GB; formula base "
          f"{WORKER_BASE_BYTES / 1e9:.2f})")
    for N, K in sizes:
        m = measure(N, K, args.scheme, "down")
        f = worker_bytes(N, K)
        peak = m["peak"]
        bad += f < peak
        print(f"{N:>6d} x {K:<6d} {m['base'] / 1e9:8.2f} {peak / 1e9:9.2f} {f / 1e9:9.2f} {f / peak:12.2f}"
              + ("  FORMULA BELOW THE MEASUREMENT" if f < peak else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
