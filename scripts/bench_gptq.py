#!/usr/bin/env python
"""GPTQ of one routed-expert matrix (default [3072, 3584]) against one same-thread matmul.

Per scheme: the seconds of ``gptq.gptq_quantize`` (default config: clip search, guard), its achieved
rate in GFLOP/s counted as 2 N K^2 (the lazy-batch update's order of work), the seconds of one
[N x K] x [K x K] float32 matmul on the same thread (measured before and after every GPTQ run; the
fastest of them), and the ratio of the two (the target is <= 4).  Everything runs on one thread (``torch.set_num_threads(1)``, numpy's BLAS
on one thread; the numba kernels are serial).  Times are CPU seconds of this process (``time.process_time``: on a shared
machine they leave out the time other processes held the core); wall seconds are printed beside them.
The load average before and after is printed: on a busy machine both clocks slow down together, so
read the ratio.

``--before REV`` also runs the calibrated path as it was at git revision REV (its GPTQ modules and
the numba kernels they used) in the same run, and says whether the bytes changed and by how much the
input-weighted error tr(dW H dW^T) moved (new / before).

The weight holds bfloat16 values (as a checkpoint's: the guard's data-free codes then come from the codec's
fast kernel, as in ``convert --calibrate``); H is (1/n) X^T X of n synthetic inputs with a few loud channels
(the cost does not depend on the values).  ``--phases`` also prints where the seconds of the new path go
(CPU seconds per phase, each phase's own time: a phase called inside another is not counted twice).

``--device cuda|npu`` instead compares GPTQ there (``GPTQConfig.device``: the factor, the candidates' GPTQ and the
judge run on the device) with the one-thread CPU path, in wall seconds (the device's queue is drained before a
clock is read), and says how close the device's codes come (a device rounds its sums differently: close, not equal).

    python scripts/bench_gptq.py [--n 3072 --k 3584 --schemes W4A8_DYNAMIC,W4A8_MXFP --before HEAD~1 --phases --repeat 3]
    python scripts/bench_gptq.py --device cuda [--repeat 2]
"""

from __future__ import annotations

import os

for _var in ("NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # numpy's BLAS too: CPU seconds of one thread, as the matmul's

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kimi_quant.dtypes import bf16_to_f32, f32_to_bf16  # noqa: E402
from kimi_quant.quant import get_codec  # noqa: E402
from kimi_quant.quant import gptq, gptq_clip, gptq_factor, gptq_judge  # noqa: E402

ROLES = {"W4A8_DYNAMIC": "down", "W8A8_DYNAMIC": None, "W4A8_MXFP": None, "W8A8_MXFP8": None}


def _git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def load_before(rev: str):
    """The calibrated entry point of revision ``rev``: a function (codec, w, matmul, H) -> tensors.

    That revision's GPTQ modules (gptq.py and every gptq_*.py beside it: its factor, judge, candidate
    grids and numba kernels; older revisions kept the block kernel in kernels.py) run from files in a
    temporary folder under names of their own (``kimi_quant.quant._before_<name>``), importing one
    another; the codecs and numerics are this tree's."""
    listed = subprocess.run(["git", "ls-tree", "--name-only", rev, "kimi_quant/quant/"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    stems = [Path(f).stem for f in listed if Path(f).name.startswith("gptq") and f.endswith(".py")]
    tmp = Path(tempfile.mkdtemp(prefix="bench_gptq_before_"))
    for stem in stems:
        src = _git_show(rev, f"kimi_quant/quant/{stem}.py")
        for other in stems:
            src = re.sub(rf"from \.{other} import", f"from ._before_{other} import", src)
        if stem == "gptq" and "gptq_int_block" in src:  # its numba kernel lived in kernels.py
            ksrc = _git_show(rev, "kimi_quant/quant/kernels.py")
            body = re.search(r"@njit\(cache=True\)\ndef gptq_int_block.*?(?=\n\n\n)", ksrc, re.S).group(0)
            (tmp / "_before_int_block.py").write_text("import numpy as np\nfrom numba import njit\n\n\n" + body + "\n")
            src = src.replace("from .base import load_kernels\n\n        block = load_kernels().gptq_int_block",
                              "from ._before_int_block import gptq_int_block as block")
        (tmp / f"_before_{stem}.py").write_text(src)
    import kimi_quant.quant as package

    package.__path__.append(str(tmp))  # the relative imports of the _before_ modules find them there
    mod = importlib.import_module("kimi_quant.quant._before_gptq")
    kept = sys.modules.get("kimi_quant.quant._before_gptq_factor", mod)._LAST_FACTOR

    class Adapter:  # the codec as that revision called it (older ones: gptq_grids(w, matmul))
        def __init__(self, codec):
            self.codec = codec

        def gptq_grids(self, w, matmul, *free):
            return self.codec.gptq_grids(w, matmul, free[0] if free else self.codec.data_free_codes(w, matmul))

        def __getattr__(self, attr):
            return getattr(self.codec, attr)

    def run(codec, w, matmul, H):
        kept.clear()
        return mod.gptq_quantize(Adapter(codec), w, matmul, H, None)

    return run


def after(codec, w, matmul, H, device: str = "cpu"):
    gptq_factor._LAST_FACTOR.clear()  # each call pays its own factor (the kept one is for q/k/v sharing one H)
    return gptq.gptq_quantize(codec, w, matmul, H, gptq.GPTQConfig(device=device))


#: (where, attribute, phase): the functions whose CPU seconds ``--phases`` charges to a phase (missing
#: ones are skipped, so that the table outlives renames); where is a module, a class or "codec"; a
#: module's function is also replaced where another GPTQ module imported it by name
def phase_table(torch, kernels):
    J = gptq_judge.Judge
    F = gptq_factor
    return [
        (F, "_prepared", "factor: prepare H'"), (torch.linalg, "cholesky_ex", "factor: Cholesky (float64)"),
        (F, "_lower_inverse_in_place", "factor: triangular inverse"), (kernels, "flip_in_place", "factor: flip"),
        (F, "_factor_once", "factor: other"), (F, "hessian_factor", "factor: other"),
        (J, "__init__", "judge: triangle blocks, floor"), (J, "fast", "judge: float32 products"),
        (J, "exact", "judge: float64 re-judging"), (J, "from_gptq", "judge: error from GPTQ"),
        (J, "choose", "judge: choice"), (J, "_pivoted_cholesky", "screen/bound: pivoted Cholesky"),
        (J, "fast_unless_beaten", "guard: lower bound"),
        (kernels, "plain_errors", "clip: screen scores"), (gptq_clip, "clip_before", "clip: other"),
        (gptq_clip, "clip_ranked", "clip: other"), (gptq, "shrunk", "shrink H"),
        (kernels, "gptq_block", "GPTQ: block kernel"), (kernels, "gather_transposed", "GPTQ: transposes"),
        (kernels, "scatter_transposed", "GPTQ: transposes"), (gptq, "gptq_run", "GPTQ: updates between blocks"),
        ("codec", "fast_data_free_codes", "guard: data-free codes"), ("codec", "gptq_grids", "candidate grids"),
        ("codec", "encode", "encode"), (gptq_judge, "values_of", "values of codes"),
        (gptq_clip, "pick_rows", "other"), (gptq, "_quantize_rows", "other"), (gptq, "gptq_quantize", "other"),
    ]


def phases(codec, fn):
    """Runs ``fn()`` with the functions of ``phase_table`` wrapped: -> {phase: own CPU seconds}."""
    import torch

    from kimi_quant.quant import gptq_kernels

    own, stack, undo = {}, [], []

    def wrap(orig, label):
        def inner(*a, **kw):
            now = time.process_time()
            if stack:
                stack[-1][1] += now  # pause the caller's clock
            stack.append([label, -now])
            try:
                return orig(*a, **kw)
            finally:
                lab, acc = stack.pop()
                now = time.process_time()
                own[lab] = own.get(lab, 0.0) + acc + now
                if stack:
                    stack[-1][1] -= now
        return inner

    for where, attr, label in phase_table(torch, gptq_kernels):
        obj = codec if where == "codec" else where
        orig = getattr(obj, attr, None)
        if orig is None:
            continue
        wrapped = wrap(orig, label)
        undo.append((obj, attr, obj.__dict__.get(attr) if where != "codec" else None, where == "codec"))
        setattr(obj, attr, wrapped)
        if isinstance(where, types.ModuleType):
            for other in (gptq, gptq_clip, gptq_factor, gptq_judge):
                if other is not where and other.__dict__.get(attr) is orig:
                    undo.append((other, attr, orig, False))
                    setattr(other, attr, wrapped)
    try:
        fn()
    finally:
        for obj, attr, orig, is_codec in reversed(undo):
            if is_codec:
                delattr(obj, attr)
            else:
                setattr(obj, attr, orig)
    return own


def timed(fn):
    c, t = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c, time.perf_counter() - t


def problem(N: int, K: int):
    """(w float32 [N, K] holding bfloat16 values, H float64 [K, K] with a few loud channels), seeded."""
    rng = np.random.default_rng(0)
    w = bf16_to_f32(f32_to_bf16((0.02 * rng.standard_normal((N, K))).astype(np.float32)))
    x = rng.standard_normal((4096, K)).astype(np.float32)
    x[:, rng.integers(0, K, 16)] *= 20
    return w, (x.T.astype(np.float64) @ x) / x.shape[0]


def compare_device(args, w, H) -> int:
    """GPTQ on ``args.device`` against the one-thread CPU path: wall seconds of each (the fastest of
    ``--repeat``), the speed-up, and how close the device's result is (rows with the CPU's values,
    tr(dW H dW^T) device / CPU)."""
    import torch

    from kimi_quant.calibrate.device import synchronize, torch_device

    dev = torch_device(args.device)
    N, K = w.shape
    a, b = torch.randn(N, K, device=dev), torch.randn(K, K, device=dev)
    for name in args.schemes.split(","):  # compile / load every kernel and the device's libraries first
        for d in ("cpu", args.device):
            after(get_codec(name), w[:8, :256].copy(), ROLES[name], H[:256, :256].copy(), d)
    (a @ b).sum().item()

    def wall(fn):
        synchronize(dev)
        t = time.perf_counter()
        out = fn()
        synchronize(dev)
        return out, time.perf_counter() - t

    t_mm = min(wall(lambda: a @ b)[1] for _ in range(5))
    print(f"matrix [{N}, {K}]; CPU path on one thread, device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else dev}"
          f"; its float32 [{N} x {K}] x [{K} x {K}] matmul {t_mm * 1e3:.2f} ms (TF32 "
          f"{'on' if dev.type == 'cuda' and torch.backends.cuda.matmul.allow_tf32 else 'off'})")
    print(f"{'scheme':<14}{'CPU s':>8}{'device s':>10}{'speed-up':>10}{'x matmul':>10}{'same rows':>11}"
          f"{'err dev/CPU':>13}")
    for name in args.schemes.split(","):
        codec, mm = get_codec(name), ROLES[name]
        best = {}
        outs = {}
        for _ in range(args.repeat):
            for d in ("cpu", args.device):
                outs[d], t = wall(lambda: after(codec, w, mm, H, d))
                best[d] = min(t, best.get(d, t))
        cpu, dv = codec.dequantize(outs["cpu"]), codec.dequantize(outs[args.device])
        rows = np.mean([np.array_equal(p, q) for p, q in zip(cpu, dv)])
        err = gptq_judge.weighted_error(w, dv, H).sum() / gptq_judge.weighted_error(w, cpu, H).sum()
        print(f"{name:<14}{best['cpu']:>8.2f}{best[args.device]:>10.2f}{best['cpu'] / best[args.device]:>9.1f}x"
              f"{best[args.device] / t_mm:>10.0f}{rows:>11.1%}{err:>13.6f}", flush=True)
    return 0


def main():
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--schemes", default="W4A8_DYNAMIC,W4A8_MXFP")
    ap.add_argument("--before", metavar="REV", help="also run the calibrated path of this git revision")
    ap.add_argument("--phases", action="store_true", help="also print the new path's CPU seconds per phase")
    ap.add_argument("--repeat", type=int, default=1, help="runs per path, alternating; each reports its fastest "
                    "(GPTQ and matmul apart: on a shared machine the load moves between runs)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"),
                    help="compare GPTQ on this device with the CPU path instead [cpu: the CPU path alone]")
    args = ap.parse_args()
    torch.set_num_threads(1)
    N, K = args.n, args.k
    w, H = problem(N, K)
    if args.device != "cpu":
        return compare_device(args, w, H)
    a, b = torch.randn(N, K), torch.randn(K, K)
    runs = [("after", after)] + ([(f"before {args.before}", load_before(args.before))] if args.before else [])
    for name in args.schemes.split(","):  # compile / load every kernel first
        for _, fn in runs:
            fn(get_codec(name), w[:8, :256].copy(), ROLES[name], H[:256, :256].copy())
    flops = 2.0 * N * K * K
    print(f"matrix [{N}, {K}], one thread; load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"{'scheme':<14}{'path':<18}{'GPTQ s':>8}{'wall s':>8}{'GFLOP/s':>9}{'matmul s':>10}{'ratio':>7}")
    for name in args.schemes.split(","):
        codec, mm = get_codec(name), ROLES[name]
        outs, best = {}, {}
        for _ in range(args.repeat):  # the paths alternate; each keeps its fastest run
            for label, fn in runs:
                _, t_mm, _ = timed(lambda: a @ b)
                outs[label], t, wall = timed(lambda: fn(codec, w, mm, H))
                _, t_mm2, _ = timed(lambda: a @ b)
                prev = best.get(label)
                best[label] = (min(t, prev[0]) if prev else t, min(wall, prev[1]) if prev else wall,
                               min(t_mm, t_mm2, prev[2]) if prev else min(t_mm, t_mm2))
        t_mm = min(v[2] for v in best.values())  # one machine rate: the fastest matmul of the scheme's runs
        for label, _ in runs:
            t, wall, _ = best[label]
            print(f"{name:<14}{label:<18}{t:>8.2f}{wall:>8.2f}{flops / t / 1e9:>9.1f}{t_mm:>10.2f}{t / t_mm:>7.2f}",
                  flush=True)
        if args.before:
            new, old = outs["after"], outs[f"before {args.before}"]
            same = all(np.array_equal(new[k].view(np.uint8), old[k].view(np.uint8)) for k in new)
            e_new = gptq_judge.weighted_error(w, codec.dequantize(new), H).sum()
            e_old = gptq_judge.weighted_error(w, codec.dequantize(old), H).sum()
            rows = np.mean([np.array_equal(p, q) for p, q in zip(codec.dequantize(new), codec.dequantize(old))])
            print(f"{'':<14}bytes {'unchanged' if same else 'changed'}; rows with the same values {rows:.1%}; "
                  f"tr(dW H dW^T) new / before {e_new / e_old:.6f}", flush=True)
        if args.phases:
            own = phases(codec, lambda: after(codec, w, mm, H))
            total = sum(own.values())
            print("  phases (CPU s): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(own.items(), key=lambda kv: -kv[1])
                                                  if v >= 0.005) + f"; sum {total:.2f}", flush=True)
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    sys.exit(main())
