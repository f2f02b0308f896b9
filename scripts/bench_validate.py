#!/usr/bin/env python
"""Wall time and peak RSS of `kimi-quant validate` (one process, measured by the kernel: ru_maxrss).

Prepare a bench checkpoint and its conversions once (bench has no tokenizer: the tiny fixture's is
copied in; its 1024 ids fit the bench vocabulary of 4096):

    python scripts/bench_validate.py --work /tmp/kq-vbench [--experts 16] [--targets a3 950dt]
        [--max-tokens 4096] [--seq-len 512] [--eager] [--tree DIR]

``--eager`` runs the reference path that loads every routed expert of a layer in fp32 up front;
``--tree DIR`` runs the kimi_quant package found in DIR instead of the installed one (e.g. an older
commit unpacked with ``git archive COMMIT kimi_quant | tar -x -C DIR``), for before/after numbers.
The last lines print the memory model fitted from the measured numbers and its full-size estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOK = REPO / "kimi_quant" / "model" / "fixtures" / "tiny"
GiB = 1024 ** 3


def sh(*args: str) -> None:
    subprocess.run(list(args), check=True)


def prepare(work: Path, experts: int, targets: list[str]) -> Path:
    src = work / f"bench-{experts}"
    if not (src / "config.json").exists():
        sh("kimi-quant", "synth", "--preset", "bench", "--num-experts", str(experts), "-o", str(src))
    for f in ("tiktoken.model", "tokenizer_config.json"):
        if not (src / f).exists():
            shutil.copy(TOK / f, src / f)
    for t in targets:
        out = work / f"bench-{experts}-{t}"
        if not (out / "quant_model_description.json").exists():
            sh("kimi-quant", "convert", str(src), "-t", t, "-o", str(out), "-q")
    return src


def run_validate(src: Path, q: Path, args, report: Path) -> dict:
    env = dict(os.environ)
    if args.tree:
        env["PYTHONPATH"] = str(Path(args.tree).resolve()) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-c", "import sys, kimi_quant; print(kimi_quant.__file__, file=sys.stderr); "
           "from kimi_quant.cli import main; sys.exit(main())", "validate",
           str(src), str(q), "--quiet", "--json", str(report), "--max-tokens", str(args.max_tokens),
           "--seq-len", str(args.seq_len)]
    if args.eager:
        cmd.append("--eager-experts")
    t0 = time.perf_counter()
    # cwd outside the repo: `python -c` puts the cwd first on sys.path, which would shadow --tree
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, cwd=args.work)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"validate failed (status {status}): {' '.join(cmd)}")
    rep = json.loads(report.read_text())
    return {"wall_s": wall, "peak_rss_gib": ru.ru_maxrss * 1024 / GiB, "ppl_bf16": rep["ppl_bf16"],
            "ppl_quant": rep["ppl_quant"], "ratio": rep["ratio"], "tokens": rep["tokens"]}


def estimate(tokens: int, seq_len: int, overhead_gb: float) -> None:
    """Peak memory of the lazy path on the full-size K3.1 Pro, from the config (fp32 everywhere, GB = 1e9 B).

    states  = 2 models x (1 + ceil(L / B)) tensors x N x H x 4        (x and the residual blocks)
    layer   = max over layers of the non-routed-expert params x 4 + one expert (3 x I x R x 4)
              + attention temporaries (MLA scores/softmax/mask 3 x N x heads x T x 4, indexer 2 x N x ih x T x 4)
    head    = V x H x 4 (one lm_head) + 2 x N x V x 4 (logits of model 0 kept for the logits agreement +
              one batch of model 1) + 2 x T x V x 8 (fp64 log-softmax of one window)
    peak    = overhead + states + max(layer, head)
    eager (before) adds every routed expert of a layer: E x 3 x I x R x 4, and kept embed + lm_head of both models.
    """
    import math

    from kimi_quant.model.presets import preset_config
    from kimi_quant.model.spec import spec_from_config

    spec = spec_from_config(preset_config("full"))
    c, t = spec.text, spec.expected_tensors(with_vision=False)
    N, T, H, V, L = tokens, seq_len, c.hidden_size, c.vocab_size, c.num_hidden_layers
    dense = experts = 0
    for i in range(L):
        lp = f"{spec.prefix}model.layers.{i}."
        d = sum(math.prod(v[0]) for n, v in t.items() if n.startswith(lp) and ".experts." not in n)
        e = sum(math.prod(v[0]) for n, v in t.items() if n.startswith(lp) and ".experts." in n)
        dense, experts = max(dense, d), max(experts, e)
    one_expert = 3 * c.moe_intermediate_size * c.routed_expert_hidden_size
    nb = 1 + math.ceil(L / (c.attn_res_block_size or L))
    states = 2 * nb * N * H * 4
    attn = 3 * N * c.num_attention_heads * T * 4 + 2 * N * int(c.index_n_heads or 0) * T * 4
    layer = dense * 4 + one_expert * 4 + attn
    head = V * H * 4 + 2 * N * V * 4 + 2 * T * V * 8
    G = 1e9
    print(f"full size, N={N} tokens, T={T}: states {states / G:.1f} GB, layer phase {layer / G:.1f} GB "
          f"(dense part {dense * 4 / G:.1f} + one expert {one_expert * 4 / G:.2f} + attention {attn / G:.1f}), "
          f"head phase {head / G:.1f} GB, overhead {overhead_gb:.1f} GB")
    print(f"  lazy peak  ~ {overhead_gb + (states + max(layer, head)) / G:.1f} GB")
    eager = overhead_gb + (states + dense * 4 + experts * 4 + attn + 4 * V * H * 4) / G
    print(f"  eager peak ~ {eager:.1f} GB (all {experts / one_expert:.0f} experts of a layer: {experts * 4 / G:.0f} GB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--targets", nargs="+", default=["a3", "950dt"])
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eager", action="store_true", help="reference path: every expert of a layer in fp32")
    ap.add_argument("--tree", default=None, help="run the kimi_quant package in this directory")
    ap.add_argument("--estimate", type=float, default=None, metavar="OVERHEAD_GB",
                    help="only print the full-size estimate, with this fixed overhead (interpreter, torch, heap)")
    args = ap.parse_args()
    if args.estimate is not None:
        estimate(args.max_tokens, args.seq_len, args.estimate)
        return
    if args.work is None:
        ap.error("--work is required")
    args.work.mkdir(parents=True, exist_ok=True)
    src = prepare(args.work, args.experts, args.targets)
    label = "tree" if args.tree else ("eager" if args.eager else "lazy")
    for t in args.targets:
        r = run_validate(src, args.work / f"bench-{args.experts}-{t}", args, args.work / f"report-{t}.json")
        print(f"{t:6s} {label:<10s} experts {args.experts}  tokens {r['tokens']}  wall {r['wall_s']:7.1f} s  "
              f"peak RSS {r['peak_rss_gib']:6.2f} GiB  ppl bf16 {r['ppl_bf16']:.6f} quant {r['ppl_quant']:.6f} "
              f"ratio {r['ratio']:.6f}", flush=True)


if __name__ == "__main__":
    main()
