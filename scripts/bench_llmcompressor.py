#!/usr/bin/env python
"""Our calibrated int4 (W4A8_DYNAMIC + GPTQ) against llm-compressor's GPTQ, same model, tokens and evaluation.

Both quantize every decoder Linear of SmolLM2-135M (bench_quality.py's set-up: bf16 weights, int4
symmetric per output channel, int8 per-token activations emulated at evaluation) from the same
calibration windows of calibration/train.jsonl, and are scored on the same heldout windows.
Time: ours = ``bench_quality.quantize_sequential`` (layer by layer: Hessians from the already-quantized
layers, GPTQ of the 210 tensors, as ``convert --calibrate``); llm-compressor = its ``oneshot`` call
(which also collects its Hessians layer by layer, from its quantized layers).  llm-compressor is not a dependency: install
it apart, e.g. ``pip install --no-deps --target DIR llmcompressor compressed-tensors loguru datasets
pyarrow pandas fsspec dill xxhash multiprocess python-dateutil pytz tzdata`` and run with
``PYTHONPATH=DIR``.

    python scripts/bench_llmcompressor.py [--calib-windows 32 --eval-windows 23 --seq 512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quality as bq  # noqa: E402


def llmcompressor_weights(model, tok, calib, damp: float, act_order: bool):
    """Run llm-compressor's GPTQ (int4, symmetric, per channel) in place; -> {linear name: dequantized weight}."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    scheme = QuantizationScheme(
        targets=["re:.*layers\\..*_proj$"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel",
                                 actorder="static" if act_order else None),
    )
    import pyarrow as pa

    # a fixed fingerprint: datasets' own one hashes the arrow schema with dill, which fails on recent
    # pyarrow (PicklingError on MonthDayNano)
    ds = Dataset(pa.Table.from_pydict({"input_ids": calib.tolist(),
                                       "attention_mask": [[1] * calib.shape[1]] * calib.shape[0]}),
                 fingerprint="kimi-quant-calibration")
    import tempfile

    # oneshot re-reads the config from the model's directory, a GGUF one here: point it at a saved copy
    cfg_dir = tempfile.mkdtemp(prefix="kq-lc-config-")
    if hasattr(model.config, "quantization_config"):  # the GGUF origin; the weights are float32 now
        del model.config.quantization_config
    model.config.save_pretrained(cfg_dir)
    model.config._name_or_path = cfg_dir
    t = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=GPTQModifier(config_groups={"g": scheme}, dampening_frac=damp,
                                                         ignore=["lm_head"]),
            num_calibration_samples=calib.shape[0], max_seq_length=calib.shape[1],
            processor=tok)  # the GGUF model has no processor files it could load itself
    dt = time.perf_counter() - t
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "weight_scale") and name.rsplit(".", 1)[-1] in bq.PROJ:
            with torch.no_grad():
                out[name] = fake_quantize(mod.weight, mod.weight_scale, getattr(mod, "weight_zero_point", None),
                                          mod.quantization_scheme.weights).float().numpy()
    return out, dt


def main():
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--eval-windows", type=int)
    ap.add_argument("--calib-windows", type=int, default=32)
    args = ap.parse_args()
    cfg = bq.GPTQConfig()
    model, tok, linears = bq.load_model()
    heldout = bq.windows(tok, "heldout", args.eval_windows, args.seq)
    calib = bq.windows(tok, "train", args.calib_windows, args.seq)
    orig = {n: m.weight.detach().clone() for n, m in linears.items()}
    print(f"GPTQ config {cfg}; heldout {tuple(heldout.shape)}, calibration {tuple(calib.shape)}, torch threads {torch.get_num_threads()}")

    sc = bq.BY_NAME["W4A8_DYNAMIC+gptq"]
    t = time.perf_counter()
    ours = bq.quantize_sequential(
        model, linears, calib,
        lambda n, H: bq.quantize_weight(sc, bq.f32_to_bf16(orig[n].numpy()), bq.PROJ[n.rsplit(".", 1)[-1]], H, cfg),
        sc.act, 4)
    t_ours = time.perf_counter() - t
    for n, m in linears.items():
        with torch.no_grad():
            m.weight.copy_(orig[n])

    def ppl_with(weights):
        for n, m in linears.items():
            with torch.no_grad():
                m.weight.copy_(torch.from_numpy(weights[n]) if weights else orig[n])
        return bq.perplexity(model, linears, heldout, "int8" if weights else None, 4)

    p_float = ppl_with(None)
    p_ours = ppl_with(ours)
    print(f"float ppl {p_float:.3f}; ours {p_ours:.3f} (x{p_ours / p_float:.3f}) in {t_ours:.1f} s", flush=True)
    ppl_with(None)
    theirs, t_lc = llmcompressor_weights(model, tok, calib, cfg.damp, cfg.act_order)
    # llm-compressor's wrapped forward fake-quantizes the weight again with the same scale: idempotent
    missing = set(linears) - set(theirs)
    if missing:
        raise SystemExit(f"llm-compressor quantized {len(theirs)} of {len(linears)} Linears (missing e.g. {min(missing)})")
    p_lc = ppl_with(theirs)
    print(f"| method | ppl | vs float | time (s) |\n|---|---|---|---|\n| float | {p_float:.3f} | 1.000 | - |")
    print(f"| kimi-quant W4A8_DYNAMIC + GPTQ (sequential, as convert --calibrate) | {p_ours:.3f} | "
          f"{p_ours / p_float:.3f} | {t_ours:.1f} |")
    print(f"| llm-compressor {__import__('llmcompressor').__version__} GPTQ int4 channel | {p_lc:.3f} | "
          f"{p_lc / p_float:.3f} | {t_lc:.1f} |")


if __name__ == "__main__":
    main()
