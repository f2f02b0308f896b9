#!/usr/bin/env python
"""Calibrated int4 (W4A8_DYNAMIC per channel, GPTQ with power-of-two candidates) on the MXFP4 stand-in of
``scripts/bench_quality.py --mxfp4-source``, for several GPTQ settings in one process: one model load, the same
evaluation windows for every variant (the first 5 and all windows of heldout and pydoc, 256 tokens each), each
variant quantized sequentially as ``convert --calibrate`` does. Ratios against the MXFP4 model with int8
activations. A variant is a JSON object of GPTQConfig fields, plus ``calib`` (calibration windows of 256 tokens,
default 8) and ``attention`` (a bench_quality scheme for q/k/v/o; default: the MLP's int4). The MLP stands for
Kimi K3's routed experts, the only MXFP4 tensors of the release; its attention is BF16, which the a3 recipe
makes W8A8_DYNAMIC (``"attention": "W8A8_DYNAMIC+gptq"`` is what ``convert --calibrate`` does to it, with its default GPTQ
settings: the variant's apply to the MLP).

    python scripts/bench_mxfp4_gptq_variants.py '{"calib": 32}' '{"calib": 32, "clip_after": true}'
    python scripts/bench_mxfp4_gptq_variants.py '{"calib": 32, "attention": "W8A8_DYNAMIC+gptq"}'
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_quality as bq  # noqa: E402
from kimi_quant.quant.gptq import GPTQConfig  # noqa: E402

SEQ = 256
MLP = ("gate_proj", "up_proj", "down_proj")  # the stand-in's routed experts


def main(argv=None) -> int:
    import torch

    variants = list(sys.argv[1:] if argv is None else argv) or ["{}"]
    torch.set_num_threads(1)
    model, tok, linears = bq.load_model()
    bq.put_on_mxfp4_grid(linears)
    evals = {n: bq.windows(tok, n, 5, SEQ) for n in ("heldout", "pydoc")}
    evals.update({n + "_all": bq.windows(tok, n, None, SEQ) for n in ("heldout", "pydoc")})
    orig = {n: m.weight.detach().clone() for n, m in linears.items()}
    u16 = {n: bq.f32_to_bf16(w.numpy()) for n, w in orig.items()}
    ref = {t: bq.perplexity(model, linears, d, "int8", 4) for t, d in evals.items()}
    scheme = bq.BY_NAME["W4A8_DYNAMIC+gptq/pow2"]
    for v in variants:
        kw = json.loads(v)
        calib = bq.windows(tok, "train", kw.pop("calib", 8), SEQ)
        attention = bq.BY_NAME[kw.pop("attention", scheme.name)]
        cfg = GPTQConfig(**{k: tuple(x) if isinstance(x, list) else x for k, x in kw.items()})

        def quantize(name, H):
            proj = name.rsplit(".", 1)[-1]
            if proj in MLP or attention is scheme:
                return bq.quantize_weight(scheme, u16[name], bq.PROJ[proj], H, cfg)
            # K3's attention is BF16: convert's own GPTQ settings, not the variant's for MXFP4 values
            return bq.quantize_weight(attention, u16[name], bq.PROJ[proj], H, GPTQConfig())

        t = time.perf_counter()
        bq.quantize_sequential(model, linears, calib, quantize, "int8", 4)
        tq = time.perf_counter() - t
        r = {k: bq.perplexity(model, linears, d, "int8", 4) / ref[k] for k, d in evals.items()}
        for n, m in linears.items():
            with torch.no_grad():
                m.weight.copy_(orig[n])
        print(v, " ".join(f"{k} {x:.4f}" for k, x in r.items()), f"(quantize {tq:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
