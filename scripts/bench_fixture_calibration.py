#!/usr/bin/env python
"""Is ``convert --calibrate`` worse than data-free on the tiny K3.1 fixture, or is that noise?

Converts the synthetic tiny fixture (``synth``) data-free and calibrated (GPTQ, --tokens
2048 of builtin:train, as tests/test_calibrate.py) for one target, then scores BF16, data-free and
calibrated side by side on the validate text (builtin:heldout), one 512-token window at a time.  Prints
both perplexity ratios for the first --tokens (what ``validate`` reports by default: 4096) and for all
of the text, with the paired per-window NLL difference (calibrated - data-free) and its standard
error over windows: |z| < 2 means the sign of the perplexity difference is not resolved by the text.

    python scripts/bench_fixture_calibration.py [--target 950dt] [--dir DIR]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kimi_quant.calibrate import CalibConfig  # noqa: E402
from kimi_quant.convert import ConvertOptions, convert  # noqa: E402
from kimi_quant.synth import synth  # noqa: E402
from kimi_quant.validate import run as vr  # noqa: E402
from kimi_quant.runtime.weights import QuantizedLoader, SourceLoader  # noqa: E402


def per_window_nll(src: Path, outs: list[Path], max_tokens: int, seq: int) -> np.ndarray:
    """[models (BF16 first), windows] mean NLL per scored token of each window."""
    windows = [w for b in vr.token_windows(src, None, max_tokens, seq) for w in b.split(1) if w.shape[1] == seq]
    rows = []
    for w in windows:
        loaders = [SourceLoader(src), *(QuantizedLoader(o) for o in outs)]
        try:
            totals, _, _ = vr._run(loaders, [w], False)
        finally:
            for ld in loaders:
                ld.close()
        rows.append([nll / cnt for nll, cnt in totals])
    return np.asarray(rows).T


def report(label: str, nll: np.ndarray) -> str:
    b, plain, cal = nll
    d = cal - plain
    se = d.std(ddof=1) / math.sqrt(len(d))
    return (f"{label}: {len(d)} windows; ppl ratio data-free {math.exp(plain.mean() - b.mean()):.5f}, calibrated "
            f"{math.exp(cal.mean() - b.mean()):.5f}; NLL/token calibrated - data-free {d.mean():+.5f} +- {se:.5f} "
            f"(z {d.mean() / se:+.2f}); calibrated better on {int((d < 0).sum())} of {len(d)} windows")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="950dt")
    ap.add_argument("--tokens", type=int, default=4096, help="validate's default text length (the first line)")
    ap.add_argument("--dir", help="work directory (kept; default a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kq-fixcal-") as tmp:
        root = Path(args.dir or tmp)
        src = root / "tiny-bf16"
        if not src.exists():
            synth("tiny", src)
        outs = []
        for kind in ("plain", "cal"):
            out = root / f"{args.target}-{kind}"
            if not out.exists():
                cal = CalibConfig(tokens=2048) if kind == "cal" else None
                convert(str(src), ConvertOptions(target=args.target, output=out, quiet=True, workers=1, calibrate=cal))
            outs.append(out)
        nll = per_window_nll(src, outs, 10**9, 512)
        n = max(1, args.tokens // 512)
        print(report(f"{args.target}, first {n * 512} tokens", nll[:, :n]))
        print(report(f"{args.target}, all builtin:heldout", nll))
    return 0


if __name__ == "__main__":
    sys.exit(main())
