"""Perplexity and per-layer agreement of a quantized ascendV1 checkpoint against its BF16 source.

Convention (state it when comparing numbers): the documents are tokenized with the checkpoint's own
tokenizer, each followed by [EOS], concatenated and cut to ``max_tokens``; the stream is split into
non-overlapping windows of ``seq_len`` tokens (the last, shorter window is kept if it has >= 2 tokens);
every token after the first of each window is scored (no context carried across windows).
``ppl = exp(mean NLL)`` over all scored tokens. BF16 and quantized models see exactly the same windows.

Both forwards run layer by layer side by side, carrying both states, so one layer of each model is
in memory at a time. After every decoder layer the running residual ``x`` of the two runs is compared:
mean per-token cosine similarity (and its minimum) and relative error ||x_q - x_bf16|| / ||x_bf16||
over all tokens; the final logits get the same entry.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import KimiQuantError
from ..layout.records import recorded
from ..runtime import forward as fw
from ..runtime.text import token_windows
from ..runtime.weights import EMBED_NAMES, HEAD_NAMES, QuantizedLoader, SourceLoader, WeightLoader

CONVENTION = ("non-overlapping windows of seq_len tokens over the [EOS]-joined token stream; "
              "every token after the first of each window scored")


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """Summed NLL of ids[:, 1:] under logits[:, :-1]. The fp64 log-softmax is formed one window at a
    time (a [T, V] fp64 temporary, not [B, T, V]: 1.3 GB instead of 10.7 GB at V=163840, 8 x 512
    tokens); the picked log-probabilities are summed in one reduction as before."""
    picked = [torch.log_softmax(logits[b, :-1].double(), dim=-1).gather(-1, ids[b, 1:].unsqueeze(-1))
              for b in range(logits.shape[0])]
    nll = -torch.stack(picked).sum().item()
    return nll, ids[:, 1:].numel()


class _Agree:
    """Accumulates cosine / relative error between two runs over token batches."""

    def __init__(self):
        self.cos_sum = 0.0
        self.cos_min = math.inf
        self.n = 0
        self.err2 = 0.0
        self.ref2 = 0.0
        self.kl_sum = 0.0
        self.kl_n = 0

    def add(self, ref: torch.Tensor, q: torch.Tensor) -> None:
        r = ref.reshape(-1, ref.shape[-1]).double()
        d = q.reshape(-1, q.shape[-1]).double()
        cos = torch.nn.functional.cosine_similarity(r, d, dim=-1, eps=1e-12)
        self.cos_sum += cos.sum().item()
        self.cos_min = min(self.cos_min, cos.min().item())
        self.n += cos.numel()
        self.err2 += (d - r).pow(2).sum().item()
        self.ref2 += r.pow(2).sum().item()

    def add_kl(self, ref_logits: torch.Tensor, q_logits: torch.Tensor) -> None:
        """Accumulate KL(p_bf16 || p_quant) of next-token distributions, one window at a time (fp64):
        unlike a perplexity ratio it cannot come out better than 1 by chance (a perturbation that
        happens to lower perplexity still diverges from the BF16 model)."""
        for b in range(ref_logits.shape[0]):
            lp = torch.log_softmax(ref_logits[b].double(), dim=-1)
            lq = torch.log_softmax(q_logits[b].double(), dim=-1)
            self.kl_sum += (lp.exp() * (lp - lq)).sum().item()
            self.kl_n += lp.shape[0]

    def result(self) -> dict[str, float]:
        out = {"cosine": self.cos_sum / max(1, self.n), "cosine_min": self.cos_min,
               "rel_error": math.sqrt(self.err2 / self.ref2) if self.ref2 > 0 else 0.0}
        if self.kl_n:
            out["kl"] = self.kl_sum / self.kl_n
        return out


def _layer_kind(cfg, i: int) -> str:
    attn = "KDA" if (cfg.is_kda(i) and not cfg.is_full_attn(i)) else ("MLA+DSA" if cfg.has_indexer else "MLA")
    return f"{attn}/{'dense' if cfg.is_dense(i) else 'MoE'}"


def _timing(t_layer: float, start: float, done: int, total: int) -> str:
    """'2/61, 3.1s, ETA 2m05s': layers done, this layer's time, the rest at the mean rate so far."""
    now = time.time()
    left = round((now - start) / done * (total - done))
    eta = f", ETA {left // 60}m{left % 60:02d}s" if done < total else ""
    return f"{done}/{total}, {now - t_layer:.1f}s{eta}"


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


@torch.inference_mode()
def _run(loaders: list[WeightLoader], batches: list[torch.Tensor], progress: bool, lazy_experts: bool = True) \
        -> tuple[list[tuple[float, int]], list[dict[str, Any]], dict[str, float] | None]:
    """Run models side by side: (nll/count per model, per-layer agreement of model k vs model 0, logits agreement).

    Resident at any time: the activations of every model (``x`` and the residual blocks per window
    batch), one decoder layer of one model without its routed experts, and the routed experts in use
    (one at a time with ``lazy_experts``; the whole layer with ``lazy_experts=False``, the eager
    reference path). The embedding is loaded only to embed, the head only to score.
    """
    cfg = loaders[0].cfg
    states = []
    for ld in loaders:
        gw, _ = ld.globals(EMBED_NAMES)
        states.append([fw.embed(gw, b) for b in batches])
        del gw
    layers: list[dict[str, Any]] = []
    n_layers = cfg.num_hidden_layers
    start = time.time()
    for i in range(n_layers):
        t0 = time.time()
        agree = _Agree()
        for k, ld in enumerate(loaders):
            w, act = ld.layer(i, lazy_experts=lazy_experts)
            if lazy_experts:
                states[k] = fw.layers_forward(cfg, i, w, states[k], act=act or None)
            else:
                states[k] = [fw.layer_forward(cfg, i, w, st, act=act or None) for st in states[k]]
            del w
        if len(loaders) > 1:
            for s0, s1 in zip(states[0], states[1]):
                agree.add(s0.x, s1.x)
            entry = {"layer": i, "kind": _layer_kind(cfg, i), **agree.result()}
            layers.append(entry)
            _log(progress, f"layer {i:3d} {entry['kind']:<12} cos {entry['cosine']:.6f} "
                           f"rel_err {entry['rel_error']:.4e}  ({_timing(t0, start, i + 1, n_layers)})")
        else:
            _log(progress, f"layer {i:3d} ({_timing(t0, start, i + 1, n_layers)})")
    totals = []
    lagree = _Agree()
    logits0 = []
    for k, ld in enumerate(loaders):
        gw, gact = ld.globals(HEAD_NAMES)
        nll, cnt = 0.0, 0
        for j, (st, ids) in enumerate(zip(states[k], batches)):
            logits = fw.head(cfg, gw, st, gact or None)
            a, c = _nll(logits, ids)
            nll += a
            cnt += c
            if k == 0:
                logits0.append(logits)
            else:
                lagree.add(logits0[j], logits)
                lagree.add_kl(logits0[j], logits)
        totals.append((nll, cnt))
        del gw
    return totals, layers, (lagree.result() if len(loaders) > 1 else None)


def _check_same_model(a: WeightLoader, b: WeightLoader) -> None:
    ta, tb = a.cfg, b.cfg
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_experts", "kda_layers", "full_attn_layers")
    diff = [k for k in keys if getattr(ta, k) != getattr(tb, k)]
    if diff:
        raise KimiQuantError(f"{b.root} is not a conversion of {a.root}: config.json differs in {', '.join(diff)}")


def perplexity_of_source(model_dir: str | Path, calibration: str | Path | None = None, max_tokens: int = 4096,
                         seq_len: int = 512, progress: bool = True) -> dict[str, Any]:
    """Perplexity of one BF16 source checkpoint (same convention as run_validation)."""
    batches = token_windows(model_dir, calibration, max_tokens, seq_len)
    with SourceLoader(model_dir) as src:
        ((nll, cnt),), _, _ = _run([src], batches, progress)
    return {"ppl": math.exp(nll / cnt), "tokens": cnt}


def run_validation(source_dir: str | Path, quant_dir: str | Path, calibration: str | Path | None = None,
                   max_tokens: int = 4096, seq_len: int = 512, json_path: str | Path | None = None,
                   progress: bool = True, lazy_experts: bool = True) -> dict[str, Any]:
    """Perplexity of the BF16 source and its ascendV1 conversion on the same windows, plus per-layer agreement.

    Returns (and writes to ``json_path`` if given) a report with ``ppl_bf16``, ``ppl_quant``, ``ratio``
    (= ppl_quant / ppl_bf16), ``tokens`` (scored tokens), ``layers`` (one entry per decoder layer:
    layer, kind, cosine, cosine_min, rel_error), ``logits`` (the same for the final logits, plus ``kl``: mean KL(BF16 || quantized) of
    the next-token distributions, nats per token), ``output_calibration`` (the output's GPTQ calibration or None), and
    ``convention``, ``seq_len``, ``windows``, ``calibration``, ``wall_s``.

    ``lazy_experts=False`` loads every routed expert of a layer up front (the former eager path, kept
    as the reference the default lazy, expert-at-a-time path is tested to match bit for bit).
    """
    t0 = time.time()
    tok_dir = source_dir if (Path(source_dir) / "tiktoken.model").is_file() else quant_dir
    batches = token_windows(tok_dir, calibration, max_tokens, seq_len)
    with SourceLoader(source_dir) as src, QuantizedLoader(quant_dir) as qnt:
        _check_same_model(src, qnt)
        totals, layers, logits = _run([src, qnt], batches, progress, lazy_experts)
    (nb, cb), (nq, cq) = totals
    ppl_b, ppl_q = math.exp(nb / cb), math.exp(nq / cq)
    report = {
        "ppl_bf16": ppl_b,
        "ppl_quant": ppl_q,
        "ratio": ppl_q / ppl_b,
        "tokens": cb,
        "layers": layers,
        "logits": logits,
        "convention": CONVENTION,
        "seq_len": seq_len,
        "windows": sum(b.shape[0] for b in batches),
        "calibration": str(calibration) if calibration is not None else "builtin:heldout",
        "source": str(source_dir),
        "quantized": str(quant_dir),
        "wall_s": round(time.time() - t0, 3),
        "output_calibration": recorded(Path(quant_dir), "calibration"),
        "output_source_packing": recorded(Path(quant_dir), "source_packing"),
    }
    if json_path is not None:
        p = Path(json_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_table(report: dict[str, Any]) -> str:
    """A printable summary of a run_validation report."""
    lines = [f"{'layer':>5}  {'kind':<12} {'cosine':>10} {'cos_min':>10} {'rel_error':>10}"]
    for e in report["layers"]:
        lines.append(f"{e['layer']:>5}  {e['kind']:<12} {e['cosine']:>10.6f} {e['cosine_min']:>10.6f} "
                     f"{e['rel_error']:>10.3e}")
    if report.get("logits"):
        e = report["logits"]
        lines.append(f"{'out':>5}  {'logits':<12} {e['cosine']:>10.6f} {e['cosine_min']:>10.6f} {e['rel_error']:>10.3e}"
                     + (f"   KL(bf16 || quant) {e['kl']:.3e} nats/token" if "kl" in e else ""))
    lines.append("(cosine: mean over tokens of the cosine between the BF16 and the quantized hidden state; cos_min: "
                 "the lowest token's; rel_error: ||x_q - x_bf16|| / ||x_bf16||)")
    lines.append("")
    lines.append(f"perplexity BF16 {report['ppl_bf16']:.4f}   quantized {report['ppl_quant']:.4f}   "
                 f"ratio {report['ratio']:.4f}   ({report['tokens']} tokens scored, {report['windows']} windows "
                 f"of <= {report['seq_len']})")
    if "output_calibration" in report:
        from ..layout.model_card import describe_calibration

        lines.append(f"output: {describe_calibration(report['output_calibration'])}")
    if report.get("output_source_packing"):
        from ..plan import packed_words

        lines.append(f"source experts: {packed_words(report['output_source_packing'])}")
    return "\n".join(lines)
