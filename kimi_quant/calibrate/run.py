"""The calibrated conversion driver (``convert --calibrate``): layer by layer, journaled, resumable.

Memory (``estimate.driver_bytes`` and ``estimate.job_bytes`` count it; ``plan --calibrate`` prints both):

  driver   one layer's non-expert weights (fp32) + 2 routed experts (the output pass: in use, read back)
         + state: T x H x 4 B x (1 + blocks + 4)            x and the residual blocks, attention out, MLP in/out
         + forward transients: the residual mix's stack, MLA scores / KDA blocks / a dense MLP's outputs
         + the Hessians of one stage formed here (float64 up to FLOAT64_MAX_K, float32 above, summed in place and
           handed to GPTQ without a copy): the attention side, or the MLP's non-routed Linears
         + the jobs handed out and not done (about 2 per worker, at most a stage's): their weights as stored in
           the source (BF16, or packed MXFP4) and a routed expert's token rows
  a job    a Linear: its weight (fp32) + its Hessian + GPTQ's working set (one K x K float32 matrix above
           FLOAT64_MAX_K, factored in place; ``gptq.working_set_bytes``); a routed expert: its three weights, its
           token rows, both its Hessians (formed there) and the working set of its largest Linear

K3.1 Pro (H 7168, R 3584, I 3072, k 16, 8192 tokens): the largest job, the layer-0 dense down projection
[7168, 33792], ~12.7 GB; the driver ~26 GB at 256 experts per stage (docs/calibration.md). Full Hessians of the whole model could never
be held ((3584^2 + 3072^2) x 8 B x 896 experts x 93 layers alone is ~15 TB): a Hessian lives only while its
Linear is quantized, and a routed expert's only in its job.

GPTQ runs on a runner (``jobs``: this process, local worker processes; ``ray_jobs``: Ray tasks): all the
Linears of a stage (the attention side; the MLP's non-routed Linears with the first batch of routed experts,
``CalibConfig.experts_per_stage``; each further batch) are handed out at once and written back in plan order as their results
arrive. A routed expert is one job (``routed.RoutedExpert``, ``jobs.ExpertJob``): the driver's forward gives it
the token rows the router sends it (every token for ``--expert-tokens all``, or an under-routed expert holding
MXFP4 values), and the job forms its Hessians and w2's input itself, with the driver's arithmetic, so that share
of the forward runs on the workers, in parallel. The forward and the other Hessians run between the stages
(no GPTQ job outstanding): here, on the cores the run was given (``forward_threads``: torch's intra-op threads;
one thread while jobs run), or with ``--executor ray`` and more than one pass of tokens data-parallel, each pass
in a Ray actor (``ray_forward``), its Hessian terms replayed here in pass order. Its products give the same bits
on any number of threads and in any process, so the bytes do not depend on it either. With ``--device
cuda|npu`` the forward, its states and the Hessians formed here live on that device (``device.py``; ``--device
cpu`` takes the same path); a routed expert's job forms its Hessians on the CPU.

Resume: the state after each finished layer is checkpointed (``kimi_quant_calib_state.safetensors``
in the output, removed when the run completes) with the journal vouching for that layer's shards;
a re-run starts at the next layer and redoes a half-written one completely (its shards come out
byte-identical: every step is deterministic on the same machine; GPTQ runs on one thread wherever it runs,
so the bytes do not depend on the runner or its number of workers).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import KimiQuantError
from ..layout.ascend_v1 import PROVENANCE
from ..model.spec import load_model_spec_from_source
from ..output_run import ConvertResult, check_window, finish_output, resume_output
from ..plan import Plan, TensorPlan, UnitPlan
from ..quant.gptq import GPTQConfig, for_mxfp4_weights
from ..quant.numerics import on_mxfp4_grid
from ..recipe.recipe import FLOAT
from ..runtime import forward as fw
from ..quant import REGISTRY
from ..runtime.weights import EMBED_NAMES, HEAD_NAMES
from .config import MIN_TOKENS, CalibConfig, partitions, windows_per_pass
from .device import DeviceWeights, full_float32, states_to, synchronize, torch_device
from .token_parts import MAX_LOSSES, LocalForward, PartitionLost
from .hessian import HessianCollector
from .jobs import GPTQJob, ProcessRunner, SerialRunner
from .phases import Phases
from .routed import RoutedExpert, Routing
from .state import STATE_FILE, load_state, save_state, state_binding
from .layer_io import Readback, SourceWeights, UnitWriter, dequantized
from .layered import ATTENTION, EXPERTS, GLOBAL, MLP, layer_of, layered_plan, relative_name, stage_of, units_by_layer

ROLES = {ATTENTION: "attention", MLP: "mlp", EXPERTS: "expert"}  # a GPTQ job's role, by stage
log = logging.getLogger(__name__)


# -- calibration text ------------------------------------------------------------------------------
@contextmanager
def _tokenizer_dir(source) -> Iterator[Path]:
    """A directory holding the source's tokenizer files (the source itself when it is local)."""
    if source.root is not None:
        yield Path(source.root)
        return
    import tempfile

    names = {f.name for f in source.files()}
    with tempfile.TemporaryDirectory(prefix="kq-tok-") as d:
        for name in ("tiktoken.model", "tokenizer_config.json"):
            if name in names:
                (Path(d) / name).write_bytes(source.read_bytes(name))
        yield Path(d)


def calibration_windows(source, cfg: CalibConfig, quiet: bool = True) -> tuple[list[torch.Tensor], dict]:
    """The calibration token windows and what identifies them (name, tokens, sha256 of the token ids)."""
    from ..runtime.text import token_windows
    from ..runtime.tokenizer import TIKTOKEN_FILE

    if cfg.tokens < MIN_TOKENS:
        raise KimiQuantError(f"--tokens {cfg.tokens} is too few: GPTQ needs at least {MIN_TOKENS} tokens "
                             "(thousands for a useful Hessian)")
    with _tokenizer_dir(source) as d:
        if not (d / TIKTOKEN_FILE).is_file():
            raise KimiQuantError(f"{source.id}: no {TIKTOKEN_FILE}: --calibrate tokenizes the calibration text with "
                                 "the source's own tokenizer; add it to the source, or convert without --calibrate")
        # in passes of at most PASS_TOKENS: the forward's transients do not grow with --tokens
        batches = [c for b in token_windows(d, cfg.calibration, cfg.tokens, cfg.seq_len)
                   for c in b.split(windows_per_pass(cfg.seq_len))]
    n = sum(b.numel() for b in batches)
    if n < MIN_TOKENS:
        raise KimiQuantError(f"calibration text {cfg.calibration} is too short: it gives {n} tokens, --calibrate "
                             f"needs at least {MIN_TOKENS} (pass a longer --calibration-data file)")
    if n < cfg.tokens and not quiet:
        print(f"kimi-quant: note: calibration text {cfg.calibration} gives only {n} tokens, fewer than "
              f"--tokens {cfg.tokens}: calibrating on {n}", file=sys.stderr)
    digest = hashlib.sha256(b"".join(b.to(torch.int64).numpy().tobytes() for b in batches)).hexdigest()
    g = gptq_config(cfg)  # record the settings in effect, defaults resolved
    info = {"method": "GPTQ", **cfg.describe(), "act_order": g.act_order, "damp": g.damp, "tokens": n, "tokens_requested": cfg.tokens,
            "windows": sum(b.shape[0] for b in batches), "token_sha256": digest}
    return batches, info


def calibrated_plan(source, plan: Plan, cfg: CalibConfig, quiet: bool = True) -> tuple[Plan, list[torch.Tensor]]:
    spec = load_model_spec_from_source(source, recipe_given=True)
    if spec.text is None:
        raise KimiQuantError(f"{source.id}: --calibrate runs the Kimi K3-family forward; this model "
                             f"({spec.config.get('model_type')!r}) is not one: convert it without --calibrate")
    batches, info = calibration_windows(source, cfg, quiet)
    return layered_plan(plan, spec, {"calibration": info}), batches


# -- GPTQ through the codec --------------------------------------------------------------------------
def gptq_config(cfg: CalibConfig) -> GPTQConfig:
    """The codecs' GPTQConfig with the user's settings (the GPTQ defaults where they gave none)."""
    given = {"damp": cfg.damp, "act_order": cfg.act_order, "device": cfg.device}
    return GPTQConfig(**{k: v for k, v in given.items() if v is not None})


def forward_threads(executor: str, workers: int | None) -> int:
    """The driver's threads for its forward: the cores the run was given on this machine (``--workers``, at most
    this machine's cores; Ray's workers are elsewhere or idle while the forward runs, so the same bound).
    The bytes do not depend on it: every op the forward issues gives the same result on any number of
    threads (tests/test_calibrate_parallel.py checks the forward's products bit for bit)."""
    from ..executor.fork_server import default_workers

    cores = os.cpu_count() or 1
    return max(1, min(int(workers or default_workers()), cores))


def workers_that_fit(source, plan: Plan, cfg: CalibConfig, executor: str, workers: int | None) -> int | None:
    """The workers of a calibrated run, checked before any work against this machine's memory (and with
    ``--device cuda|npu`` the device's free memory) by ``plan --calibrate``'s own accounting (``estimate.memory``):
    hours into a run the OOM killer would say nothing. Local and no ``--workers``: as many of one per core as fit,
    saying so if fewer; a run that cannot fit (the driver and its workers' largest jobs; with Ray the driver) is
    refused in one line."""
    from ..progress import fmt_size
    from .device import free_bytes
    from .estimate import DEVICE_CONTEXT_BYTES, machine_memory_bytes, memory

    spec = load_model_spec_from_source(source, recipe_given=True)
    local = executor == "local"
    n = _local_workers(workers) if local else int(workers or 1)
    have = {"memory": machine_memory_bytes(), "device": free_bytes(cfg.device)}
    need = memory(plan, spec, cfg, executor)

    def short(m: dict) -> str | None:  # what the run would not fit in
        if m["peak"] > have["memory"]:
            return "memory"
        return "device" if have["device"] is not None and m["device"] > have["device"] else None

    def amount(m: dict, what: str) -> str:
        return (f"~{fmt_size(m['peak'])} of memory here, this machine has {fmt_size(have['memory'])}"
                if what == "memory" else
                f"~{fmt_size(m['device'])} of {cfg.device} memory, the device has {fmt_size(have['device'])} free")

    m = need(n)
    what = short(m)
    if what is None:
        return workers
    if local and not workers:
        fit, over = 0, n  # the most that fit (the peak grows with the workers: a bisection, ~2 s a step on K3.1)
        while over - fit > 1:
            mid = (fit + over) // 2
            fit, over = (mid, over) if short(need(mid)) is None else (fit, mid)
        if fit:
            log.warning("kimi-quant: note: %d workers would need %s: using %d", n, amount(m, what), fit)
            return fit
        m, n = need(1), 1
        what = short(m)
    beside = (f" and {n} GPTQ jobs of up to {fmt_size(m['worker'])} each" if n > 1 else
              f" and its GPTQ jobs of up to {fmt_size(m['worker'])}") if local else ""
    if what == "device" and local and n > 1:
        beside += f", in {n} processes with a device context of ~{fmt_size(DEVICE_CONTEXT_BYTES)} each"
    ways = (["fewer --workers"] if local and n > 1 else []) + ["fewer --tokens", "a smaller --expert-batch"] \
        + (["--executor ray"] if local else []) + (["--device cpu"] if what == "device" else []) \
        + ["a larger machine" if what == "memory" else "a larger device"]
    held = m["driver"]["total"] if what == "memory" else m["device_driver"]
    raise KimiQuantError(f"--calibrate needs {amount(m, what)} (the driver {fmt_size(held)}{beside}): use "
                         f"{', '.join(ways[:-1])} or {ways[-1]} (`kimi-quant plan --calibrate` sizes a run)")


def make_runner(executor: str, workers: int | None, options: dict | None = None, device: str = "cpu"):
    """The runner of ``convert --calibrate --executor E --workers N --device D`` (local: one process per core by
    default; one worker runs in this process; each opens ``device`` itself)."""
    if executor == "ray":
        from .ray_jobs import RayRunner  # optional extra: pip install kimi-quant[ray]

        return RayRunner(workers, device=device, **(options or {}))
    n = _local_workers(workers)
    return SerialRunner() if n <= 1 else ProcessRunner(n)


def _local_workers(workers: int | None) -> int:
    """``--workers`` of a local run (default one per core), refused past 8 per core."""
    from ..executor.fork_server import default_workers

    n = int(workers or default_workers())
    most = 8 * (os.cpu_count() or 1)
    if n > most:  # each holds a GPTQ working set: a typo'd 100000 would exhaust the machine
        raise KimiQuantError(f"--workers {n} is more than {most} (8 per core on this machine): more processes "
                             "than that only cost memory; use fewer")
    return n


class _Quantizer:
    """Writes a run of tensors: GPTQ (on the runner, all of them at once) where a Linear has a Hessian, the
    data-free rule elsewhere; keeps the counts the run reports."""

    def __init__(self, cfg: CalibConfig, runner, forward_threads: int = 1):
        self.cfg = cfg
        self.gptq = gptq_config(cfg)
        self.runner = runner
        self.forward_threads = forward_threads
        self.device = torch_device(cfg.device)  # the forward's and the Hessians' (calibrate/device.py)
        self.phases = Phases(lambda: synchronize(self.device))
        self.stats = {"gptq_tensors": 0, "data_free_tensors": 0, "routed_experts": 0, "fallback_experts": 0,
                      "never_routed_experts": 0, "all_token_experts": 0}
        self.expert_tokens: list[int] = []  # tokens each routed expert's Hessian saw, in run order

    def final_stats(self) -> dict:
        """The counts, with the fewest and the median tokens a routed expert's Hessian saw."""
        out = dict(self.stats)
        if self.expert_tokens:
            out["expert_tokens_min"] = min(self.expert_tokens)
            out["expert_tokens_median"] = int(statistics.median_low(self.expert_tokens))
        return out

    def write(self, writer: UnitWriter, ts: list[TensorPlan], hessian_of: dict, role: dict[str, str],
              experts: dict[str, RoutedExpert] | None = None) -> dict:
        """Write ``ts`` in plan order; ``hessian_of[name]``: a callable giving its Hessian, or ``experts[name]``: the
        routed expert it belongs to, which forms its Hessians where its job runs (absent from both: the data-free
        rule); ``role[name]``: attention, mlp, expert or head. Returns name -> its outputs (None for FLOAT)."""
        from ..executor.unit import release_source, source_values

        experts = experts or {}
        calibrated = set()
        for t in ts:
            if t.scheme == FLOAT:
                continue
            if hessian_of.get(t.name) is None and t.name not in experts:
                self.stats["data_free_tensors"] += 1
                continue
            self.stats["gptq_tensors"] += 1
            if not t.repack:  # the source's own MXFP4 codes are written as they are
                calibrated.add(t.name)

        def job(t: TensorPlan) -> GPTQJob:
            with self.phases("read"):
                w = source_values(writer.reader, t)  # the worker decodes it
                release_source(writer.reader, t)
            gptq = for_mxfp4_weights(self.gptq) if holds_mxfp4_values(t, None if t.packed else w.f32()) \
                else self.gptq
            h = hessian_of[t.name]() if t.name not in experts else None
            return GPTQJob(t.name, role[t.name], t.scheme, t.group_size, t.pow2_scale, t.matmul, w, h, gptq)

        def jobs():  # read as the runner takes them: only its window of weights is held at once
            todo = [t for t in ts if t.name in calibrated]
            for key, group in itertools.groupby(todo, key=lambda t: experts.get(t.name)):
                if key is None:
                    yield from (job(t) for t in group)
                else:
                    yield key.job(writer.reader, [job(t) for t in group], self.phases)

        results = self.runner.run(jobs())
        outs = {}
        try:
            for t in ts:
                with self.phases("gptq"):  # in this process (1 worker), else waiting for the workers
                    got = next(results) if t.name in calibrated else None
                with self.phases("write"):
                    outs[t.name] = writer.put(t, got)
            return outs
        finally:
            results.close()

    @contextmanager
    def forward(self) -> Iterator[None]:
        """A section of the driver's forward (on ``self.device``): no GPTQ job is outstanding, so it has the run's
        cores (torch's intra-op threads; the stage's GPTQ jobs run on one thread each, with these set back to one)."""
        with self.phases("forward"), full_float32(self.device):
            torch.set_num_threads(self.forward_threads)
            try:
                yield
            finally:
                torch.set_num_threads(1)


# -- the driver --------------------------------------------------------------------------------------------
@torch.inference_mode()
def run_calibrated(source, plan: Plan, windows: list[torch.Tensor], out_dir: Path, journal, opts, t0: float):
    from ..progress import NoBar, progress_bar

    cfg: CalibConfig = opts.calibrate
    spec = load_model_spec_from_source(source, recipe_given=True)
    tcfg = spec.text
    # One thread, but in the forward (_Quantizer.forward): the GPTQ workers have the cores, and torch's idle
    # intra-op threads would spin on them
    torch.set_num_threads(1)
    r = resume_output(source, plan, out_dir, journal, opts, all_inputs=True)
    check_window(source.max_disk, r.todo, r.entries)  # the same --max-disk bound as a data-free run
    info = dict(plan.extra["calibration"])
    binding = state_binding(plan.fingerprint(), r.made_from, info, cfg)
    quant = _Quantizer(cfg, None, forward_threads(opts.executor, opts.workers))
    layers_done = 0
    total = sum(u.in_bytes for u in r.todo)
    bar = (NoBar(total) if opts.quiet or total == 0 else
           progress_bar(total, f"calibrate {plan.target}", smoothing=0.1))
    weights = SourceWeights(source, spec)
    try:
        if r.todo:
            with make_runner(opts.executor, opts.workers, opts.executor_options, cfg.device) as quant.runner:
                layers_done = _run_layers(tcfg, source, plan, windows, out_dir, journal, r, quant, weights, bar,
                                          binding, spec, _forward_of(tcfg, opts, quant))
    finally:
        bar.close()
        weights.close()
    if layers_done == 0 and not r.todo:
        quant.stats = _previous_stats(out_dir) or quant.stats
    info["stats"] = quant.final_stats()
    with quant.phases("finish"):
        finish_output(source, plan, out_dir, journal, opts, r, {"calibration": info})
        (out_dir / STATE_FILE).unlink(missing_ok=True)
    quant.phases.save(time.perf_counter() - t0, {"forward_threads": quant.forward_threads})
    return ConvertResult(plan, out_dir, time.perf_counter() - t0, len(r.todo), len(r.done),
                         sum(u.in_bytes for u in r.todo), source.peak_staged_bytes, info)


def _forward_of(tcfg, opts, quant: _Quantizer):
    """Where the forward runs: with Ray, on the CPU and over more than one pass of ``PASS_TOKENS``, each pass in a
    Ray actor of its own (``ray_forward``: data-parallel, the same bytes); else in this process."""
    def of(states: list):
        if partitions(quant.cfg, opts.executor) > 1:  # as plan counts them
            from .ray_forward import RayForward

            return RayForward(tcfg, states, quant.phases, quant.forward_threads)
        return LocalForward(tcfg, states, quant.device, quant.phases)
    return of


def _run_layers(tcfg, source, plan: Plan, windows, out_dir: Path, journal, r, quant: _Quantizer,
                weights: SourceWeights, bar, binding: str, spec, forward_of) -> int:
    """Every layer still to do, from the saved state if there is one, then the globals; the layers run.
    ``forward_of(states)``: where the forward runs over them (``token_parts``). A part of the forward lost with
    its process (``PartitionLost``) is said in one line and the run goes on from the last layer checkpointed."""
    by_layer = units_by_layer(plan, spec)
    pending = {L for L, us in by_layer.items() if any(u.file not in r.done for u in us)}  # before this run
    fresh = dict(quant.stats), list(quant.expert_tokens)
    source.prefetch(plan.source_order())
    first, lost = None, 0
    while True:
        start, states = _starting_point(windows, out_dir, binding, quant, weights, pending, fresh)
        first = start if first is None else first
        pending = set()  # what is checkpointed from now on was written by this run
        fwd = forward_of(states)
        del states  # fwd holds them (another process may)
        try:
            _layers_from(start, tcfg, source, plan, out_dir, journal, r, quant, weights, bar, binding, spec, fwd,
                         by_layer)
            return tcfg.num_hidden_layers - first
        except PartitionLost as e:
            lost += 1
            if lost > MAX_LOSSES:
                raise KimiQuantError(f"{e}; it was lost {lost} times: run the same command again to resume from "
                                     "the last layer done") from e
            log.warning("kimi-quant: warning: %s; redoing the work since the last layer checkpointed (attempt %d of "
                        "%d)", e, lost + 1, MAX_LOSSES + 1)
        finally:
            fwd.close()


def _starting_point(windows, out_dir: Path, binding: str, quant: _Quantizer, weights: SourceWeights,
                    pending: set[int], fresh: tuple[dict, list]) -> tuple[int, list]:
    """(the first layer to do, the state before it): from the checkpoint, with the run's counts then, if there is
    one and no layer up to its own has output shards still to do (``pending``), else from the embedding, with the
    counts of a run that starts (``fresh``)."""
    resumed = load_state(out_dir, binding, windows)
    if resumed is not None:
        layer, saved, stats, expert_tokens = resumed
        if not any(0 <= L <= layer for L in pending):
            quant.stats.update((k, v) for k, v in stats.items() if k in quant.stats)
            quant.expert_tokens = expert_tokens
            return layer + 1, states_to(saved, quant.device)
    quant.stats, quant.expert_tokens = dict(fresh[0]), list(fresh[1])
    gw, _ = weights.globals(EMBED_NAMES)
    with quant.forward():
        gw = DeviceWeights(gw, quant.device)
        return 0, [fw.embed(gw, b.to(quant.device)) for b in windows]


def _layers_from(start: int, tcfg, source, plan: Plan, out_dir: Path, journal, r, quant: _Quantizer,
                 weights: SourceWeights, bar, binding: str, spec, fwd, by_layer: dict) -> None:
    """Layers ``start``.. with ``fwd`` holding the state before ``start``, each checkpointed; then the globals
    (``by_layer``: ``units_by_layer``)."""
    n_layers = tcfg.num_hidden_layers
    last_use = _last_use(plan, spec, n_layers)
    for i in range(start, n_layers):
        bar.set_postfix_str(f"layer {i + 1}/{n_layers}", refresh=True)  # the layer being worked on, 1-based
        writer = UnitWriter(out_dir, by_layer.get(i, []), journal, r.made_from, weights, bar.update)
        try:
            with quant.phases("layers"):  # what the phases inside leave out: Python, the weights' reads
                _layer(tcfg, i, weights, fwd, writer, quant, quant.cfg, out_dir, by_layer.get(i, []), spec)
        except BaseException:
            writer.abort()
            raise
        with quant.phases("state"):
            save_state(out_dir, binding, i, fwd.layout(), fwd.passes(), quant.stats, quant.expert_tokens)
        _release(source, weights, last_use, i)
    writer = UnitWriter(out_dir, by_layer.get(GLOBAL, []), journal, r.made_from, weights, bar.update)
    try:
        _globals(tcfg, weights, fwd, writer, quant, spec)
    except BaseException:
        writer.abort()
        raise


def _previous_stats(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / PROVENANCE).read_text())["calibration"]["stats"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _last_use(plan: Plan, spec, n_layers: int) -> dict[str, int]:
    last: dict[str, int] = {}
    for t in plan.tensors():
        layer = layer_of(spec, t.name)
        for f in t.files:
            last[f] = max(last.get(f, -1), n_layers if layer == GLOBAL else layer)
    return last


def _release(source, weights: SourceWeights, last_use: dict[str, int], layer: int) -> None:
    for f, last in last_use.items():
        if last == layer:
            weights.drop(f)
            source.release(f)


def _layer(tcfg, i: int, weights: SourceWeights, fwd, writer: UnitWriter, quant: _Quantizer,
           cfg: CalibConfig, out_dir: Path, units: list[UnitPlan], spec) -> None:
    """Quantize and write layer i; ``fwd`` (``token_parts``) then holds the state after it."""
    w_src, _ = weights.layer(i)
    w = DeviceWeights(w_src, quant.device)  # what the forward reads: on its device
    tensors = [t for u in units for t in u.tensors]
    rel = {t.name: relative_name(spec, t.name) for t in tensors}
    stage = {t.name: stage_of(spec, t.name) for t in tensors}
    by_stage = {s: [t for t in tensors if stage[t.name][0] == s] for s in (ATTENTION, MLP, EXPERTS)}
    quantized = lambda ts: [rel[t.name] for t in ts if t.scheme != FLOAT]  # noqa: E731
    propagate = cfg.propagate == "quantized"
    act = {rel[t.name]: REGISTRY[t.scheme].activation for t in tensors if t.scheme != FLOAT and propagate}
    coll = HessianCollector()
    deq: dict[str, torch.Tensor] = {}

    def emit(ts: list[TensorPlan], experts: dict[str, RoutedExpert] | None = None) -> None:
        """GPTQ every Linear of ``ts`` that saw a token, and the routed experts given (all at once, on the
        runner); write them all."""
        def hessian(name: str):
            return lambda: coll.hessian(name)

        given = {t.name: hessian(rel[t.name]) for t in ts if t.scheme != FLOAT and coll.tokens(rel[t.name]) > 0}
        outs = quant.write(writer, ts, given, {t.name: ROLES[stage[t.name][0]] for t in ts}, experts)
        for t in ts:
            if outs[t.name] is not None and propagate and stage[t.name][0] != EXPERTS:
                deq[rel[t.name]] = dequantized(t, outs[t.name])
        coll.drop(rel[t.name] for t in ts)

    # 1. attention side: Hessians from the incoming state, then quantize, then re-run it as quantized
    coll.want(quantized(by_stage[ATTENTION]))
    with quant.forward():
        fwd.attention(i, w, coll)
    emit(by_stage[ATTENTION])
    if propagate and deq:
        with quant.forward():
            fwd.attention(i, w, None, deq, act)
    # 2. the MLP: its non-routed Linears from one pass, which also gives the routed experts' input and the
    # router's choice; each routed expert is a job of its own that forms its Hessians from its rows
    coll.want(quantized(by_stage[MLP]))
    with quant.forward():
        # the routed experts themselves run here only for a BF16-propagated output (their jobs observe them)
        batches = fwd.mlp(i, w, coll, propagate)
    experts = _routed_experts(tcfg, by_stage[EXPERTS], stage, Routing(batches), quant, cfg, w_src, rel)
    # handed out a batch of experts at a time: the driver holds the weights of at most that many jobs
    order = sorted({stage[t.name][1] for t in by_stage[EXPERTS]})
    per_stage = cfg.experts_per_stage(quant.runner.workers)
    for j in range(0, max(1, len(order)), per_stage):
        batch = set(order[j:j + per_stage])
        emit((by_stage[MLP] if j == 0 else []) + [t for t in by_stage[EXPERTS] if stage[t.name][1] in batch],
             experts)
    if writer.next_tensor() is not None:
        raise RuntimeError(f"layer {i}: {writer.next_tensor().name} was never written")
    if not propagate:
        return
    # 3. the layer's output as the device will compute it: dequantized weights, activation fake-quant
    readback = Readback(out_dir, units, spec)
    try:
        with quant.forward():
            fwd.output(i, w, deq, readback, act)
    finally:
        readback.close()


def _routed_experts(tcfg, tensors: list[TensorPlan], stage: dict, routing: Routing, quant: _Quantizer,
                    cfg: CalibConfig, w_src, rel: dict[str, str]) -> dict[str, RoutedExpert]:
    """Tensor name -> its routed expert, for the experts that get GPTQ; the run's counts of those that saw too few
    tokens (they keep the data-free rule, but an expert whose weights are MXFP4 values is calibrated on every
    token instead: the data-free int4 rule cannot hold them and the plan fixed int4 for the whole fused layer)."""
    by_expert: dict[int, list[TensorPlan]] = {}
    for t in tensors:
        by_expert.setdefault(stage[t.name][1], []).append(t)
    routed = routing.tokens_per_expert(tcfg.num_experts)
    every = cfg.expert_tokens == "all"
    out = {}
    for e, ts in sorted(by_expert.items()):
        if all(t.scheme == FLOAT for t in ts):
            continue
        n = routing.tokens if every else routed[e]
        quant.stats["routed_experts"] += 1
        quant.stats["never_routed_experts"] += n == 0
        quant.stats["fallback_experts"] += 0 < n < cfg.min_expert_tokens
        on_all = not every and n < cfg.min_expert_tokens and _mxfp4_expert(ts, w_src, rel)
        if on_all:
            n = routing.tokens
            quant.stats["all_token_experts"] += 1
        quant.expert_tokens.append(n)
        if n > 0 and n >= cfg.min_expert_tokens:
            expert = RoutedExpert(e, tuple(ts), routing, every or on_all, tcfg)
            out.update((t.name, expert) for t in ts)
    return out


def _mxfp4_expert(ts: list[TensorPlan], w_src, rel: dict[str, str]) -> bool:
    """Whether every quantized tensor of a routed expert holds MXFP4 values (a packed source, or its BF16
    decoding: the same bytes either way) that the plan makes per-channel int4 (the rule that breaks them
    without data; per-group int4 and int8 keep their data-free rules)."""
    ts = [t for t in ts if t.scheme != FLOAT and not t.repack]
    return bool(ts) and all(t.scheme == "W4A8_DYNAMIC" and not t.group_size
                            and holds_mxfp4_values(t, w_src[rel[t.name]].numpy()) for t in ts)


def holds_mxfp4_values(t: TensorPlan, w) -> bool:
    """Whether ``t``'s weight ``w`` (float32 numpy; not looked at for a packed source) is MXFP4 values: a packed
    source's, or its BF16 decoding (the same bytes either way: each 32-block is E2M1 levels times a power of two)."""
    return bool(t.packed) or on_mxfp4_grid(w)


def _globals(tcfg, weights: SourceWeights, fwd, writer: UnitWriter, quant: _Quantizer, spec) -> None:
    """Embedding, final norms, lm_head (GPTQ from the final state if it is quantized), vision: last."""
    tensors = writer.remaining()
    coll = HessianCollector()
    wanted = [relative_name(spec, t.name) for t in tensors if t.scheme != FLOAT]
    if wanted:
        coll.want(wanted)
        gw, gact = weights.globals(HEAD_NAMES)
        with quant.forward():
            fwd.head(DeviceWeights(gw, quant.device), coll)
        del gw
    rel = {t.name: relative_name(spec, t.name) for t in tensors}
    given = {t.name: (lambda n=rel[t.name]: coll.hessian(n)) for t in tensors
             if t.scheme != FLOAT and coll.tokens(rel[t.name]) > 0}
    quant.write(writer, tensors, given, {t.name: "head" for t in tensors})
