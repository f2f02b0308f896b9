"""``plan --calibrate``: wall time and memory of a calibrated conversion on a described cluster.

The run (calibrate/run.py) is one driver, layer by layer, and GPTQ jobs spread over the workers:

* the driver runs the forward of the calibration tokens through every layer, serially, on its own
  threads (``min(workers, cores of this machine)``: while it runs no GPTQ job is outstanding, so it has the
  run's cores; run.forward_threads): per layer the attention twice (observed, then re-run quantized), the
  MLP's non-routed Linears twice (observed, and the output from the bytes written), the routed experts once
  (the output), and it forms the Hessians of the non-routed Linears (``2 K^2`` per token per distinct input);
* the GPTQ jobs of one stage (a layer's attention; its dense or non-routed MLP Linears with the first batch of
  ``CalibConfig.experts_per_stage`` routed experts; each further batch) run at once over the workers: the stage takes
  ``max(sum of its jobs / workers, its longest job)``; local workers are capped at this machine's
  cores, Ray workers are not. A routed expert is one job: it forms its Hessians from its token rows (k/E of
  the tokens on average, or with ``--expert-tokens all`` every token) and w2's input before its GPTQs
  (``_expert_job_flops``), so that work is spread over the workers too.

Rates, measured here in well under a second each: fp32 matmul on one thread (the forward's Linears,
attention scores, Hessian products), seconds per element of the attention's elementwise work, the
fixed cost of one small torch op (the forward's Python overhead per op), and GPTQ on two small
matrices per scheme, fitted to ``a K + b (N K^2 + K^3)``. All of them are CPU rates: with ``--device cuda|npu``
the times are those of the run on CPUs (no device rate is measured) and say so; the memory then names what
lives on the device (``driver_bytes``' weights, state, forward and Hessians). Start-up is stated in ``STARTUP_S`` (measured:
docs/calibration.md). Memory: ``driver_bytes`` and ``worker_bytes`` below (the run's own accounting,
checked against measured peaks by scripts/measure_gptq_memory.py).
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from ..plan import Plan
from ..recipe.recipe import FLOAT
from .config import PASS_TOKENS, CalibConfig, partitions, passes, windows_per_pass
from .hessian import hessian_bytes
from .layered import EXPERTS, GLOBAL, MLP, stage_of

PROBE = (1024, 2048)
#: seconds before the first layer, by executor: Python, torch and the runtime imported, the calibration text
#: tokenized and embedded, workers started (Ray: the cluster joined, each worker's imports); measured, see
#: docs/calibration.md
STARTUP_S = {"local": 3.0, "ray": 15.0}
#: resident bytes of a worker process before its job (Python, numpy, torch, the GPTQ kernels):
#: scripts/measure_gptq_memory.py measures it
WORKER_BASE_BYTES = 400 * 1024**2
#: the driver's resident bytes besides its model state (Python, torch, the runtime, tokenizer, readers):
#: measured on the tiny model's calibrated convert (docs/calibration.md)
DRIVER_BASE_BYTES = 600 * 1024**2
#: the device memory a CUDA / NPU context takes in each process that opens the device (the driver, and each local
#: worker process with ``--device cuda|npu``), beside what the process allocates there
DEVICE_CONTEXT_BYTES = 600 * 1024**2
#: torch ops the forward issues per layer pass outside the routed experts (norms, attention, residual mixes),
#: and per routed expert that runs (gather, three Linears, the GLU, the scatter-add); counted in
#: runtime/forward.py
OPS_PER_LAYER_PASS = 150
OPS_PER_EXPERT = 14
#: elementwise passes over an MLA score matrix (scale, mask, softmax, indexer scores and top-k) and over a
#: KDA chunk's [C, C] and [C, d] blocks
SCORE_PASSES = 12
KDA_PASSES = 40


def _rate(dtype, n: int = 512, seconds: float = 0.25) -> float:
    """FLOP/s of one n^3 matmul on one thread: the best of as many as fit in ``seconds`` of this thread's CPU
    time (at least 3). CPU time is robust when other work time-shares the cores; the span is not: one 512^3
    product takes ~3 ms, and a core just out of idle ran the first few at a quarter of its speed (plan's
    forward estimate then swung 4x between runs)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(n, n, dtype=dtype)
        best, start, runs = float("inf"), time.thread_time(), 0
        while runs < 3 or time.thread_time() - start < seconds:
            t = time.thread_time()
            a @ a
            best = min(best, time.thread_time() - t)
            runs += 1
    finally:
        torch.set_num_threads(threads)
    return 2 * n ** 3 / best


def _overheads() -> tuple[float, float]:
    """(seconds of one small torch op, seconds per element of a large elementwise pass) on one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, w = torch.randn(4, 16), torch.randn(16, 16)
        big = torch.randn(4, 256, 256)
        op, elem = float("inf"), float("inf")
        for _ in range(3):
            t = time.thread_time()
            for _ in range(100):
                x @ w
            op = min(op, (time.thread_time() - t) / 100)
            t = time.thread_time()
            torch.softmax(big, dim=-1)
            elem = min(elem, (time.thread_time() - t) / big.numel())
    finally:
        torch.set_num_threads(threads)
    return op, elem


#: the job kind of an int4 per-channel tensor whose source is packed MXFP4: ``convert --calibrate`` runs
#: ``gptq.for_mxfp4_weights``'s settings on it (more candidate scales, H shrunk toward its diagonal)
MXFP4_KIND = " from MXFP4"


def _packed_to_int4(tp) -> bool:
    """Whether a planned tensor is a packed MXFP4 source requantized to int4 per channel (the calibrated run
    gives it the MXFP4 settings, and an all-token pass when its expert is under-routed)."""
    return bool(tp.packed) and not tp.repack and tp.scheme == "W4A8_DYNAMIC" and not tp.group_size


def job_kind(tp) -> str:
    """The GPTQ rate a planned tensor is costed at: its scheme, with MXFP4_KIND where its source is packed MXFP4
    requantized to int4 per channel (a BF16 decoding of such a release is not known before its values are
    read: costed at the float rate)."""
    return tp.scheme + MXFP4_KIND if _packed_to_int4(tp) else tp.scheme


def _gptq_seconds(kind: str, matmul: str | None, n: int, k: int) -> float:
    """One-core seconds of GPTQ on an [n, k] matrix of job kind ``kind`` (``job_kind``)."""
    import torch

    from ..quant import get_codec
    from ..quant import numerics as nm
    from ..quant.gptq import GPTQConfig, for_mxfp4_weights, gptq_quantize

    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    scheme, cfg = kind, GPTQConfig()
    if kind.endswith(MXFP4_KIND):
        scheme, cfg = kind[:-len(MXFP4_KIND)], for_mxfp4_weights(cfg)
        codes, scales = nm.mxfp4_ocp_quantize(w)
        w = nm.mx_dequantize(nm.e2m1_to_f32(codes), scales).astype(np.float32)
    x = rng.standard_normal((2 * k, k))
    h = x.T @ x / len(x)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = time.thread_time()
        gptq_quantize(get_codec(scheme), w, matmul, h, cfg)
        return time.thread_time() - t
    finally:
        torch.set_num_threads(threads)


def gptq_model(kind: str, matmul: str | None) -> tuple[float, float, float]:
    """(c, a, b) of t(N, K) = c + a K + b (N K^2 + K^3) seconds on one core: a fixed cost per job (c, an
    [8, 64] matrix), per column (GPTQ walks the K columns one at a time) and O(N K^2 + K^3) arithmetic,
    fitted to two measured sizes."""
    sizes = [(256, 512), PROBE]
    _gptq_seconds(kind, matmul, 8, 64)  # loads the kernels: not part of any probe
    c = min(_gptq_seconds(kind, matmul, 8, 64) for _ in range(3))
    ts = [_gptq_seconds(kind, matmul, n, k) - c for n, k in sizes]
    A = np.array([[k, n * k * k + k ** 3] for n, k in sizes], dtype=np.float64)
    a, b = np.linalg.solve(A, np.array(ts))
    if a < 0 or b < 0:  # noise: fall back to the pure FLOP model through the larger probe
        n, k = PROBE
        return c, 0.0, max(ts[1], 0.0) / (n * k * k + k ** 3)
    return c, float(a), float(b)


def _models_path():
    from ..cache import cache_dir

    return cache_dir() / "gptq_rates.json"


def gptq_models(schemes: dict[str, str | None]) -> dict[str, tuple[float, float, float]]:
    """``gptq_model`` per job kind ({``job_kind``: a matmul it is used for}), stored in the kimi-quant cache for this
    machine and this code (the probes take a few seconds; ``plan`` is asked often)."""
    import json

    from .. import __version__
    from ..cache import cpu_key, read_private, write_private
    from ..estimate import code_fingerprint

    ident = f"{__version__} {cpu_key()} {code_fingerprint()}"
    stored = {}
    try:
        d = json.loads((read_private(_models_path()) or b"{}").decode())
        if isinstance(d, dict) and d.get("ident") == ident and isinstance(d.get("models"), dict):
            stored = {s: tuple(float(x) for x in v) for s, v in d["models"].items()
                      if isinstance(v, list) and len(v) == 3 and all(isinstance(x, float) and x >= 0 for x in v)}
    except (ValueError, TypeError, UnicodeDecodeError):
        stored = {}
    todo = [s for s in schemes if s not in stored]
    for s in todo:
        stored[s] = gptq_model(s, schemes[s])
    if todo:
        try:
            write_private(_models_path(), json.dumps({"ident": ident, "models": {s: list(v) for s, v in
                                                                                 stored.items()}}).encode())
        except OSError:
            pass  # a read-only cache costs the probes next time
    return {s: stored[s] for s in schemes}


def _linears(plan: Plan, spec):
    """(tensor, N, K, layer, stage, expert, shares its input) of every 2-D Linear, one role lookup each.
    Linears fed the same input share one Hessian (q/k/v of a KDA layer, gate/up of an MLP or expert)."""
    out = []
    for tp in plan.tensors():
        if len(tp.shape) != 2:
            continue
        role = spec.role(tp.name)
        if not role.linear:
            continue
        layer = GLOBAL if role.layer is None else role.layer
        stage, expert = (EXPERTS, role.expert) if role.expert is not None else stage_of(spec, tp.name)
        shares = role.matmul in ("gate", "up") or role.role == "kda.qkv_proj"
        out.append((tp, *tp.shape, layer, stage, expert, shares))
    return out


def _hessian_key(name: str, layer: int, stage: int, expert: int, K: int, shares: bool) -> tuple:
    """The key of a Linear's input: the stage is part of it (an attention input and an MLP input of the
    same layer and width are different tensors); a Linear that shares nothing gets its own key."""
    return (layer, stage, expert, K, True) if shares else (layer, stage, expert, K, name)


def _expert_rows(t, cfg: CalibConfig) -> float:
    """Token rows a routed expert's job gets on average: T k / E routed, or every token."""
    return cfg.tokens if cfg.expert_tokens == "all" else cfg.tokens * t.num_experts_per_token / t.num_experts


def _expert_job_flops(members: list, rows: float) -> float:
    """Flops a routed expert's job spends before its GPTQ (``jobs.ExpertJob``): the Hessian of w1 / w3 from its rows
    (2 R^2 per row), and w2's input, ``glu(rows W1^T, rows W3^T)`` (4 R I per row), and its Hessian (2 I^2)."""
    gate_up = [(N, K) for _, m, N, K in members if m != "down"]
    down = [(N, K) for _, m, N, K in members if m == "down"]
    flops = 2 * rows * gate_up[0][1] ** 2 if gate_up else 0.0
    if down:
        N, I = down[0]
        flops += rows * (4 * N * I + 2 * I * I)  # N = R (w2 is [R, I])
    return flops


class Job(NamedTuple):
    """A GPTQ job as the run hands it out: ``members`` [(``job_kind``, matmul, N, K)] (a routed expert: all its
    Linears), the flops it spends forming its Hessians, (layer, expert) of a routed expert (else None), and the
    source bytes of its weights (what the driver holds for it until it is done)."""

    members: list
    flops: float
    expert: tuple | None
    source_bytes: int


def _jobs_and_hessians(linears: list, t, cfg: CalibConfig, per_stage: int):
    """Per GPTQ stage (layer, stage, batch of ``per_stage`` experts), as the run hands them out: its ``Job``s (a routed expert: all its Linears in one job,
    its Hessians formed there; the MLP's non-routed Linears go with the first batch of experts), and the stage's
    Hessian keys formed on the driver {key: K}; per layer the fp32 bytes of its non-expert weights; the bytes of one
    routed expert's weights."""
    linear_jobs = defaultdict(list)
    expert_jobs = defaultdict(lambda: defaultdict(list))
    hess = defaultdict(dict)
    nonexpert = defaultdict(int)
    expert_bytes = defaultdict(int)
    expert_source = defaultdict(int)
    for tp, N, K, layer, stage, expert, shares in linears:
        if stage == EXPERTS:
            expert_bytes[(layer, expert)] += 4 * N * K
        elif layer != GLOBAL:
            nonexpert[layer] += 4 * N * K
        if tp.scheme == FLOAT:
            continue
        if stage == EXPERTS:
            group = (layer, EXPERTS, expert // per_stage)
            expert_jobs[group][expert].append((job_kind(tp), tp.matmul, N, K))
            expert_source[(layer, expert)] += tp.in_bytes
            continue
        group = (layer, EXPERTS, 0) if stage == MLP else (layer, stage, 0)
        linear_jobs[group].append(Job([(job_kind(tp), tp.matmul, N, K)], 0.0, None, tp.in_bytes))
        hess[group][_hessian_key(tp.name, layer, stage, expert, K, shares)] = K
    jobs = defaultdict(list, linear_jobs)
    rows = _expert_rows(t, cfg) if t.num_experts else 0.0
    for group, by_expert in expert_jobs.items():
        jobs[group] += [Job(members, _expert_job_flops(members, rows), (group[0], e), expert_source[(group[0], e)])
                        for e, members in by_expert.items()]
    return jobs, hess, nonexpert, max(expert_bytes.values(), default=0)


def under_routed_share(T: int, p: float, floor: int) -> float:
    """The share of routed experts seeing fewer than ``floor`` of ``T`` tokens when each token picks an expert
    with probability ``p`` (balanced routing: binomial; a skewed router leaves more below the floor)."""
    if floor <= 0 or p <= 0:
        return 0.0
    if p >= 1:
        return float(T < floor)
    log = lambda j: (math.lgamma(T + 1) - math.lgamma(j + 1) - math.lgamma(T - j + 1)  # noqa: E731
                     + j * math.log(p) + (T - j) * math.log1p(-p))
    return min(1.0, sum(math.exp(log(j)) for j in range(min(floor, T + 1))))


def _all_token_experts(linears: list, every: bool) -> set:
    """(layer, expert) of each routed expert whose weights are a packed source's MXFP4 values made per-channel int4:
    when under-routed, its job gets every token's rows (``--expert-tokens all`` already gives them to every
    expert)."""
    if every:
        return set()
    return {(layer, expert) for tp, _, _, layer, stage, expert, _ in linears if stage == EXPERTS and _packed_to_int4(tp)}


def worker_bytes(N: int, K: int, kind: str = "") -> int:
    """Resident bytes of a worker quantizing one [N, K] Linear of job kind ``kind`` (``job_kind``): its base, the
    weight (float32), the Hessian as received (``hessian.hessian_bytes``) and GPTQ's working set
    (``gptq.working_set_bytes``, with the shrunk copy of H for MXFP4 weights)."""
    from ..quant.gptq import working_set_bytes

    return WORKER_BASE_BYTES + 4 * N * K + hessian_bytes(K) + working_set_bytes(N, K, kind.endswith(MXFP4_KIND))


def job_bytes(members: list, rows: float) -> int:
    """Resident bytes of a worker running one job: a Linear (``worker_bytes``), or a routed expert (``rows`` > 0):
    all its weights, its token rows, both its Hessians, w2's input being formed (three [rows, I] float32 blocks)
    and the GPTQ working set of its largest Linear."""
    from ..quant.gptq import working_set_bytes

    if not rows:
        return worker_bytes(*members[0][2:], members[0][0])
    kind, _, N, K = max(members, key=lambda m: worker_bytes(m[2], m[3], m[0]))
    R = next((k for _, m, _, k in members if m != "down"), N)
    I = next((k for _, m, _, k in members if m == "down"), 0)
    return (WORKER_BASE_BYTES + sum(4 * n * k for _, _, n, k in members) + int(4 * rows * (R + 3 * I))
            + hessian_bytes(R) + (hessian_bytes(I) if I else 0) + working_set_bytes(N, K, kind.endswith(MXFP4_KIND)))


def driver_bytes(spec, cfg: CalibConfig, layer_weights: int, expert_weights: int, stage_hessians: int,
                 in_flight: int = 0, actors: bool = False) -> dict:
    """The driver's resident bytes at its peak, by part (the run's accounting, ``calibrate/run.py``):

    * weights: one layer's non-expert Linears (fp32) + two routed experts (the one in use and a read-back);
    * state: T tokens x H x 4 B: the carried x and the closed residual blocks (1 + blocks), the layer's
      attention output and MLP input, the observed MLP output and the layer's output (4 more);
    * the largest transient of the forward (they come one after another), of one pass of P tokens (``P =
      min(T, PASS_TOKENS)`` in whole windows): the residual mix's stacked blocks (3 x (1 + blocks) x P x H x 4 B),
      MLA's score matrices (3 x windows of P x heads x seq^2 x 4 B), KDA's per-token blocks (8 x P x heads x
      head_dim x 4 B), a dense MLP's gate/up/GLU outputs (3 x P x I x 4 B), or the MoE's latent input and
      output (of all T tokens: the routed experts' jobs take their rows from it);
    * Hessians: the largest stage's sums formed here (attention; the MLP's non-routed Linears: a routed expert's
      are formed by its job) (``hessian_bytes`` each; float64 up to FLOAT64_MAX_K) plus one float64 hand-out copy,
      as GPTQ is fed one job at a time, plus the collector's float32 product and its float64 cast for the widest
      float64 input (12 K^2);
    * jobs: ``in_flight``, the weights (and a routed expert's rows) of the jobs handed out and not yet done (the
      runner's window: ``jobs.JOBS_PER_WORKER`` per worker, at most a stage's).

    ``actors``: the forward runs in Ray actors (``ray_forward``): the state here is one pass's x and blocks at a
    time (checkpointed as they come), and of the forward only the routed experts' input of every token and one
    actor's Hessian terms (float32, half the stage's float64 sums) are here."""
    t = spec.text
    T, H = cfg.tokens, t.hidden_size
    blocks = -(-t.num_hidden_layers // t.attn_res_block_size) if t.attn_res_block_size else 0
    act = T * H * 4
    windows = min(max(1, T // cfg.seq_len), windows_per_pass(cfg.seq_len))  # of one pass
    P = min(T, windows * cfg.seq_len)
    mla = 3 * windows * t.num_attention_heads * cfg.seq_len ** 2 * 4
    kda = 8 * P * t.kda_num_heads * t.kda_head_dim * 4 if t.kda_num_heads else 0
    dense = 3 * P * (t.intermediate_size or 0) * 4
    parts = {"weights": layer_weights + 2 * expert_weights,
             "state": act * (1 + blocks + 4),
             # one at a time: the residual mix, then the attention, then the MLP (the MoE's latent in/out)
             "forward": max(3 * (1 + blocks) * P * H * 4, mla, kda, dense + 2 * T * (t.latent_size or H) * 4),
             "hessians": stage_hessians,
             "jobs": in_flight,
             "base": DRIVER_BASE_BYTES}
    if actors:
        parts["state"] = P * H * 4 * (1 + blocks)
        parts["forward"] = T * (t.latent_size or H) * 4 + stage_hessians // 2
    parts["total"] = sum(parts.values())
    return parts


def machine_memory_bytes() -> int:
    """This machine's memory as this process may use it: the physical RAM, or a smaller cgroup limit."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit) as f:
                total = min(total, int(f.read().split()[0]))
        except (OSError, ValueError, IndexError):  # absent, or "max"
            pass
    return total


def _memory(spec, cfg: CalibConfig, jobs: dict, hess: dict, nonexpert: dict, expert_w: int, rows: float,
            gptq_workers: int, local_workers: int, written: int | None = None) -> dict:
    """{driver: ``driver_bytes``, worker: the largest job's bytes, worker_shape: its largest Linear's [N, K], peak:
    the driver with ``local_workers`` of a stage's largest jobs held beside it on this machine (every local worker
    process holds its job, also when there are more processes than cores)}."""
    from .jobs import JOBS_PER_WORKER

    stage_h = 0
    for keys in hess.values():
        ks = list(keys.values())
        copy = max((8 * K * K for K in ks if hessian_bytes(K) == 8 * K * K), default=0)
        stage_h = max(stage_h, sum(hessian_bytes(K) for K in ks) + copy + copy // 8 * 12)
    window = JOBS_PER_WORKER * gptq_workers
    held = lambda j: j.source_bytes + (4 * rows * j.members[0][3] if j.expert else 0)  # noqa: E731 (+ its rows)
    in_flight = max((sum(sorted((held(j) for j in js), reverse=True)[:window]) for js in jobs.values()), default=0)
    driver = driver_bytes(spec, cfg, max(nonexpert.values(), default=0), expert_w, stage_h, int(in_flight),
                          actors=written is not None)
    if written:  # forward actors: the layer's routed experts as written, read here and put in the object store
        driver = {**driver, "written_experts": 2 * written, "total": driver["total"] + 2 * written}
    size = lambda j: job_bytes(j.members, rows if j.expert else 0)  # noqa: E731
    biggest = max((j for js in jobs.values() for j in js), key=size, default=None)
    shape = max(biggest.members, key=lambda m: m[2] * m[3])[2:] if biggest else (0, 0)
    beside = max((sum(sorted(map(size, js), reverse=True)[:local_workers]) for js in jobs.values()), default=0)
    return {"driver": driver, "worker": size(biggest) if biggest else WORKER_BASE_BYTES, "worker_shape": list(shape),
            "peak": driver["total"] + beside, **_device_bytes(cfg, driver, beside, local_workers)}


def _device_bytes(cfg: CalibConfig, driver: dict, beside: int, local_workers: int) -> dict:
    """With ``--device cuda|npu``, the device memory of the run's processes on this machine: {device: all of it,
    device_driver: the driver's forward, states and Hessians there and its context}. Local GPTQ jobs run there too
    (in the driver with one worker, else in each worker process, with a context each), counted at their CPU bytes
    (``job_bytes``: their weight, Hessian and working set go to the device; a routed expert's rows stay on the CPU,
    so this errs high). Ray's jobs run on their own nodes: not counted. Zeros on the CPU."""
    if cfg.device == "cpu":
        return {"device": 0, "device_driver": 0}
    own = sum(driver[k] for k in ("weights", "state", "forward", "hessians")) + DEVICE_CONTEXT_BYTES
    workers = local_workers * DEVICE_CONTEXT_BYTES if local_workers > 1 else 0
    return {"device": own + beside + workers, "device_driver": own}


def _gptq_workers(workers: int, executor: str, cores: int) -> int:
    """The workers that run GPTQ at once: local ones are capped at the cores, Ray's are not."""
    return max(1, min(workers, cores) if executor == "local" else workers)


def memory(plan: Plan, spec, cfg: CalibConfig, executor: str = "local") -> Callable[[int], dict]:
    """``estimate``'s memory alone, as a function of the worker count (no rate is measured; the plan's Linears
    are read once, so trying several counts is cheap): {driver: its bytes by part, worker: the largest job's,
    worker_shape, peak: this machine's (local: the driver and its workers' largest jobs at once; Ray: the
    driver)}."""
    linears = _linears(plan, spec)
    rows = _expert_rows(spec.text, cfg) if spec.text.num_experts else 0.0
    written = _written_experts_bytes(plan, spec) if partitions(cfg, executor) > 1 else None

    def for_workers(workers: int) -> dict:
        jobs, hess, nonexpert, expert_w = _jobs_and_hessians(linears, spec.text, cfg, cfg.experts_per_stage(workers))
        return _memory(spec, cfg, jobs, hess, nonexpert, expert_w, rows,
                       _gptq_workers(workers, executor, os.cpu_count() or 1), workers if executor == "local" else 0,
                       written)

    return for_workers


def estimate(plan: Plan, spec, cfg: CalibConfig, workers: int, executor: str = "local",
             driver_cores: int | None = None) -> dict:
    """{hours, wall_seconds, parts of the time, driver and worker memory, ...} of a calibrated conversion of
    ``plan`` with ``workers`` on ``executor``; the driver (its forward) runs on ``min(workers, driver_cores)``
    threads, as the run sets them (``driver_cores``: the driving machine's cores, default this one's; local
    workers are capped at them too). Rates are this machine's, per core."""
    import torch

    t = spec.text
    T = cfg.tokens
    k, E = t.num_experts_per_token, t.num_experts
    cores = driver_cores or os.cpu_count() or 1
    gptq_workers = _gptq_workers(workers, executor, cores)
    threads = max(1, min(workers, cores))  # the driver's forward
    fp32 = _rate(torch.float32)
    op_s, elem_s = _overheads()
    linears = _linears(plan, spec)
    per_stage = cfg.experts_per_stage(workers)  # as the runner sets it
    jobs, hess, nonexpert, expert_w = _jobs_and_hessians(linears, t, cfg, per_stage)
    every = cfg.expert_tokens == "all"
    rows = _expert_rows(t, cfg) if E else 0.0

    # GPTQ jobs (a routed expert's with its Hessians): per stage, over the workers. Routed MXFP4 experts under
    # --min-expert-tokens get every token's rows (run.py, ``on_all``): the expected share of them under balanced
    # routing is counted, and the wall if every one were
    models = gptq_models({s: m for js in jobs.values() for j in js for s, m, _, _ in j.members})
    cost = lambda s, m, N, K: models[s][0] + models[s][1] * K + models[s][2] * (N * K * K + K ** 3)  # noqa: E731
    on_all = _all_token_experts(linears, every)
    under = under_routed_share(T, k / E, cfg.min_expert_tokens) if E and not every else 0.0

    def gptq_time(all_token: float) -> tuple[float, float, float]:  # (wall, core seconds, job gflop)
        wall = core = gflop = 0.0
        for js in jobs.values():
            secs = []
            for members, flops, expert, _ in js:
                if expert in on_all:  # that share of it on every token's rows
                    flops += all_token * (_expert_job_flops(members, T) - flops)
                secs.append(sum(cost(*m) for m in members) + flops / fp32)
                gflop += flops / 1e9
            core += sum(secs)
            wall += max(sum(secs) / gptq_workers, max(secs))
        return wall, core, gflop

    gptq_wall, gptq_core, job_gflop = gptq_time(under if on_all else 0.0)
    all_token_worst_s = (gptq_time(1.0)[0] - gptq_wall) if on_all else 0.0
    per_expert = {}
    for js in jobs.values():
        for members, _, expert, _ in js:
            for s, m, N, K in members:
                if expert is not None and m in ("gate", "up") and s not in per_expert:
                    per_expert[s] = cost(s, m, N, K)

    # forward and Hessians: serial in the driver, on its threads: the attention twice (observed, then quantized),
    # the non-routed MLP twice (observed, then the output from the bytes written), the routed experts once (the
    # output; a BF16-propagated run runs them in the observed pass instead)
    fwd_flops = hess_flops = 0.0
    layers = t.num_hidden_layers
    bf16 = cfg.propagate != "quantized"
    for tp, N, K, layer, stage, _, shares in linears:
        share = k / E if stage == EXPERTS else 1.0
        runs = 1.0 if layer == GLOBAL or stage == EXPERTS or bf16 else 2.0
        fwd_flops += 2 * N * K * share * runs * T
    for keys in hess.values():
        for key, K in keys.items():
            hess_flops += 2 * K * K * T
    windows = max(1, T // cfg.seq_len)
    mla_layers = sum(1 for i in range(layers) if not (t.is_kda(i) and not t.is_full_attn(i)))
    kda_layers = layers - mla_layers
    score = windows * cfg.seq_len ** 2
    qk = (t.qk_nope_head_dim or 0) + (t.qk_rope_head_dim or 0) + (t.v_head_dim or 0)
    attn_s_1 = (mla_layers * score * (t.num_attention_heads * 2 * qk / fp32
                                      + (t.num_attention_heads + (t.index_n_heads or 0)) * SCORE_PASSES * elem_s))
    if kda_layers:
        d, C = t.kda_head_dim, 64
        attn_s_1 += kda_layers * T * t.kda_num_heads * (6 * d * (d + C) / fp32 + KDA_PASSES * (d + C) * elem_s)
    n_passes = passes(cfg)
    ops = n_passes * (layers * 4 * OPS_PER_LAYER_PASS
                      + (layers - t.first_k_dense_replace) * min(E, T * k // n_passes) * OPS_PER_EXPERT)
    fwd_s_1 = fwd_flops / fp32 + 2 * attn_s_1 + ops * op_s
    hess_s_1 = hess_flops / fp32
    parts = partitions(cfg, executor)
    fwd_cores = _forward_cores(parts, threads, workers)
    forward_wall = (fwd_s_1 + hess_s_1) / fwd_cores
    startup = STARTUP_S.get(executor, STARTUP_S["local"])
    wall = startup + forward_wall + gptq_wall

    written = _written_experts_bytes(plan, spec) if parts > 1 else None
    mem = _memory(spec, cfg, jobs, hess, nonexpert, expert_w, rows, gptq_workers, workers if executor == "local" else 0,
                  written)
    driver = mem["driver"]
    part_mem = _partition_bytes(spec, cfg, max(nonexpert.values(), default=0)) + written if parts > 1 else 0
    return {"hours": wall / 3600, "wall_seconds": wall, "workers": workers, "executor": executor,
            "driver_cores": driver_cores,
            "gptq_workers": gptq_workers, "driver_threads": threads, "startup_s": startup,
            "forward_s": fwd_s_1 / fwd_cores, "hessian_s": hess_s_1 / fwd_cores, "gptq_s": gptq_wall,
            "core_hours": (fwd_s_1 + hess_s_1 + gptq_core) / 3600, "gptq_core_h": gptq_core / 3600,
            "forward_core_h": fwd_s_1 / 3600, "hessian_core_h": hess_s_1 / 3600,
            "forward_gflop": fwd_flops / 1e9, "hessian_gflop": hess_flops / 1e9, "job_gflop": job_gflop,
            "max_parallel_jobs": max((len(js) for js in jobs.values()), default=0), "experts_per_stage": per_stage,
            "expert_tokens": cfg.expert_tokens, "expert_tokens_mean": rows,
            "all_token_experts": len(on_all), "under_routed_share": under, "all_token_worst_s": all_token_worst_s,
            "fp32_gflops": fp32 / 1e9, "op_us": op_s * 1e6, "gptq_s_per_expert_matrix": per_expert,
            "driver_memory_bytes": driver["total"], "driver_memory": driver,
            "worker_memory_bytes": mem["worker"], "worker_memory_tensor_shape": mem["worker_shape"],
            "memory_bytes": mem["peak"],
            "device": cfg.device, "rates_from": "cpu", "device_memory_bytes": mem["device"],
            "forward_partitions": parts, "partition_memory_bytes": part_mem}


def _forward_cores(parts: int, threads: int, workers: int) -> int:
    """The cores the forward runs on: the driver's threads, or with partitions each actor's (as many as the
    driver's), at most the cluster's cores (``workers``)."""
    return threads if parts <= 1 else max(threads, min(parts * threads, workers))


def _partition_bytes(spec, cfg: CalibConfig, layer_weights: int) -> int:
    """One forward actor's resident bytes at its peak, beside the layer's routed experts as written (sent whole
    through the object store, dequantized one at a time): the state and forward transient of its pass and one
    layer's non-expert weights (``driver_bytes`` for one pass's tokens)."""
    d = driver_bytes(spec, replace(cfg, tokens=min(cfg.tokens, PASS_TOKENS)), layer_weights, 0, 0)
    return d["weights"] + d["state"] + d["forward"] + d["base"]


def _written_experts_bytes(plan: Plan, spec) -> int:
    """The largest layer's routed experts as written."""
    written: dict[int, int] = {}
    for tp in plan.tensors():
        role = spec.role(tp.name)
        if role.expert is not None and role.layer is not None:
            written[role.layer] = written.get(role.layer, 0) + tp.out_bytes
    return max(written.values(), default=0)
