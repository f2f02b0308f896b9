"""The conversion driver: source -> plan -> executor (units) -> journal -> metadata files.

The driver alone owns the output directory's journal, index, description and provenance;
executors only write output shards. Every step is resumable: re-running the same command
after a crash redoes only what the journal does not vouch for.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import KimiQuantError
from .executor import make_executor
from .executor.base import Executor
from .executor.shards import PART_BYTES, run_shards
from .journal import Journal, check_same_conversion
from .lock import OUTPUT_LOCK, output_lock
from .layout.ascend_v1 import (OWN_FILES, files_to_copy, output_name)
from .layout.model_card import CARD
from .model.spec import load_model_spec_from_source
from .output_run import ConvertResult, check_claim, check_window, finish_output, resume_output
from .plan import DEFAULT_MAX_SHARD_SIZE, PER_GROUP_LOADERS, Plan, check_mxfp4_source_rules, make_plan
from .progress import NoBar, progress_bar
from .recipe import load_recipe
from .source import Source, open_source
from .targets import resolve_target
from .untrusted import inside

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .calibrate import CalibConfig


INTERRUPTED = "kimi-quant: interrupted; re-run the same command to resume"


@dataclass
class ConvertOptions:
    target: str
    output: Path
    recipe: str | None = None
    overrides: list[str] = field(default_factory=list)
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    workers: int | None = None
    executor: str = "local"
    executor_options: dict = field(default_factory=dict)
    overwrite: bool = False
    quiet: bool = False
    revision: str | None = None
    source_options: dict = field(default_factory=dict)
    hash_inputs: bool = False  # sha256 local source shards no hub vouched for (~0.55 core-s per GB, as much as converting)
    calibrate: "CalibConfig | None" = None  # GPTQ with Hessians from a layer-streamed forward (kimi_quant.calibrate)
    part_bytes: int = PART_BYTES  # input bytes per job: shards are written by many workers at once, in parts this size
    group_size: int | None = None  # a3: per-group int4 for W4A8_DYNAMIC, G inputs per scale (0: per output
    # channel; None: the recipe's group_size, default 0)


def build_plan(source: Source, target_name: str, recipe_path=None, overrides=(), max_shard_size=DEFAULT_MAX_SHARD_SIZE,
               group_size: int | None = None, calibrated: bool = False):
    """The plan of a conversion; refuses one whose rules are known to ship a broken model (``calibrated``:
    whether GPTQ will quantize, see ``plan.check_mxfp4_source_rules``)."""
    target = resolve_target(target_name)
    spec = load_model_spec_from_source(source, recipe_given=recipe_path is not None)
    recipe = load_recipe(target.name, recipe_path, list(overrides))
    plan = make_plan(source, spec, recipe, target, max_shard_size, group_size, calibrated)
    check_mxfp4_source_rules(plan, calibrated)
    return plan


def _journal_identity(plan: Plan) -> dict:
    return {"target": plan.target, "revision": plan.revision, "recipe": plan.recipe.get("name"),
            "recipe_sha256": plan.recipe.get("sha256"), "tool_version": plan.tool_version}


def journal_options(plan: Plan, opts: ConvertOptions) -> dict:
    """The options that made ``plan``, as the journal records them (``journal.PLAN_OPTIONS``): a re-run
    that differs names them, and the command that finishes the output is built from them."""
    return {"source": plan.source, "target": plan.target,
            "recipe": str(Path(opts.recipe).resolve()) if opts.recipe else None, "overrides": list(opts.overrides),
            "max_shard_size": plan.max_shard_size, "revision": plan.revision,
            "group_size": opts.group_size,  # None when not given: journals from before it stay equal
            **({"calibrate": journal_calib_options(opts.calibrate)} if opts.calibrate is not None else {})}


def journal_calib_options(cfg) -> dict:
    """--calibrate's settings as the journal records them (``journal.CALIB_OPTIONS``); a calibration file
    by its absolute path, so the command that finishes the output works from any directory."""
    text = cfg.calibration
    if not text.startswith("builtin:") and Path(text).expanduser().exists():
        text = str(Path(text).expanduser().resolve())
    out = {"calibration": text, "tokens": cfg.tokens, "act_order": cfg.act_order, "damp": cfg.damp,
           "min_expert_tokens": cfg.min_expert_tokens}
    if cfg.expert_tokens != "routed":  # recorded only when given: journals from before it stay equal
        out["expert_tokens"] = cfg.expert_tokens
    return out


def prepare_output(out_dir: Path, plan: Plan, overwrite: bool, will_write: list[str] = (),
                   options: dict | None = None) -> Journal:
    """Open (or start) the journal, refusing to mix two conversions in one directory. The caller holds
    the directory's lock (``output_lock``). ``will_write``: files besides the shards this run writes
    (``--overwrite`` refuses to replace one of them that kimi-quant did not write). ``options``: the
    options that made the plan, recorded in the journal (``journal_options``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    journal = Journal(out_dir)
    summary = _journal_identity(plan)
    fingerprint = plan.fingerprint()
    # A journal torn before its first line was complete (and stale .partial files) mean a kimi-quant
    # run died at its very start: not someone else's files.
    others = sorted(p.name for p in out_dir.iterdir()
                    if p.name not in (journal.path.name, OUTPUT_LOCK) and p.suffix != ".partial")
    if journal.start is None and others:  # never cleared, even with --overwrite: it may be anyone's directory
        raise KimiQuantError(f"{out_dir} is not empty (it holds {others[0]!r}{' and more' if len(others) > 1 else ''}) "
                             "and is not a kimi-quant output; choose an empty or new --output "
                             "(--overwrite only replaces an earlier kimi-quant output)")
    differs = journal.start is not None and journal.start.get("fingerprint") != fingerprint
    if differs and not overwrite:
        check_same_conversion(journal, fingerprint, summary, out_dir, options)
    if differs and overwrite:
        _clear_output(out_dir, journal, will_write)
        journal = Journal(out_dir)
    for stale in out_dir.rglob("*.partial"):  # copied files may live in subdirectories
        stale.unlink()
    if journal.start is None:
        # the shard count lets `verify` say how far an unfinished output got
        journal.begin(fingerprint, {**summary, "units": len(plan.units),
                                    **({"options": options} if options is not None else {})})
    return journal


def _ours(out_dir: Path, journal: Journal) -> set[str]:
    """What an earlier conversion wrote into ``out_dir``, as the journal records it (names it has checked:
    relative, no '..'), and the names only kimi-quant uses (a shard finished but not yet journaled)."""
    ours = set(journal.units) | journal.written | set(OWN_FILES) | {"config.json"}
    ours |= {p.name for p in out_dir.iterdir() if p.name.startswith(("quant_model_", "kimi_quant_"))}
    return ours


def _clear_output(out_dir: Path, journal: Journal, will_write=()) -> None:
    """--overwrite: delete what the earlier conversion wrote, and only that; anything else (a user's
    notes, a folder) is left in place, and one of those the new conversion would replace is refused."""
    ours = _ours(out_dir, journal)
    theirs = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*")
                    if (p.is_file() or p.is_symlink()) and str(p.relative_to(out_dir)) not in ours
                    and p.name not in (OUTPUT_LOCK, journal.path.name) and p.suffix != ".partial")
    clash = sorted(set(theirs) & set(will_write))
    if clash:
        raise KimiQuantError(f"--overwrite: {out_dir / clash[0]} was not written by kimi-quant and the new conversion "
                             "would replace it: move it out of --output first")
    for name in sorted(ours):
        p = out_dir / name
        if (p.is_symlink() or p.is_file()) and inside(p.parent, out_dir):  # unlink removes a link, not its target
            p.unlink()
            for d in (out_dir / name).parents:  # folders that held only our copies
                if d == out_dir or not inside(d, out_dir):
                    break
                try:
                    d.rmdir()
                except OSError:
                    break
    for stale in out_dir.rglob("*.partial"):
        stale.unlink()
    journal.path.unlink(missing_ok=True)  # last: until here a crash leaves a journal that still knows it all
    if theirs:
        log.warning("kimi-quant: warning: --overwrite kept %d file(s) kimi-quant did not write in %s: %s",
                    len(theirs), out_dir, ", ".join(theirs[:5]) + (" ..." if len(theirs) > 5 else ""))


def convert(source_spec: str, opts: ConvertOptions) -> ConvertResult:
    t0 = time.perf_counter()
    target = resolve_target(opts.target)  # refuse unsupported targets before touching anything
    executor = source = lock = None
    ok = False
    try:
        if opts.executor == "local" and opts.calibrate is None:  # workers load the kernels while the driver plans
            executor = make_executor("local", opts.workers, None)
            executor.start()  # held before it starts: a Ctrl-C meanwhile still reaches shutdown below
        source = open_source(source_spec, revision=opts.revision, **opts.source_options)
        out_dir = Path(opts.output).resolve()
        _refuse_overlap(source.root, out_dir, "the source directory")
        _refuse_overlap(source.work_dir, out_dir, "the hub staging directory (--work-dir)")
        lock = output_lock(out_dir)
        made_dir = not out_dir.exists()
        out_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()  # two runs into one directory would mix their shards (released in finally)
        plan = build_plan(source, target.name, opts.recipe, opts.overrides, opts.max_shard_size, opts.group_size,
                          calibrated=opts.calibrate is not None)
        will_write = [*map(output_name, files_to_copy(source)), "config.json", CARD]
        if opts.calibrate is not None:
            from .calibrate.run import calibrated_plan, run_calibrated, workers_that_fit

            plan, windows = calibrated_plan(source, plan, opts.calibrate, quiet=opts.quiet)
            # a run this machine cannot hold is refused (or given fewer default workers) before the output is touched
            opts = replace(opts, workers=workers_that_fit(source, plan, opts.calibrate, opts.executor, opts.workers))
            journal = prepare_output(out_dir, plan, opts.overwrite, will_write, journal_options(plan, opts))
            _warn_loaders(plan)
            result = run_calibrated(source, plan, windows, out_dir, journal, opts, t0)
            ok = True
            return result
        journal = prepare_output(out_dir, plan, opts.overwrite, will_write, journal_options(plan, opts))
        _warn_loaders(plan)
        executor = executor or make_executor(opts.executor, opts.workers, None, **opts.executor_options)  # Ray: now
        result = _run(source, plan, out_dir, journal, opts, t0, executor)
        ok = True
        return result
    except KeyboardInterrupt as e:  # say so at once: stopping the workers may take a moment
        from tqdm import tqdm

        tqdm.write(INTERRUPTED, file=sys.stderr)  # on a line of its own, whatever a bar left on the line
        e.reported = True  # the CLI does not say it twice
        raise
    finally:
        if executor is not None:
            executor.shutdown(abort=not ok)
        if source is not None:
            source.close()
        if lock is not None:
            lock.release(keep_file=lock.found and not ok)
            if made_dir and not ok and not any(out_dir.iterdir()):
                out_dir.rmdir()  # refused before writing anything: leave no trace


def _warn_loaders(plan: Plan) -> None:
    """Per-group int4 loads only in some vLLM-Ascend releases (and SGLang misreads it): said once the run is
    accepted (a refused run says one line) and before the work."""
    if plan.int4_group_size:
        log.warning("kimi-quant: warning: --group-size %d: %s; --group-size 0 writes what all of them load",
                    plan.int4_group_size, PER_GROUP_LOADERS)


def _refuse_overlap(source_dir: Path | None, out_dir: Path, what: str) -> None:
    """An output that is, holds or sits in the source directory would be cleared by --overwrite
    (deleting the BF16 shards) or copied into itself on every run; likewise the hub staging area."""
    if source_dir is None:
        return
    src = Path(source_dir).resolve()
    how = ("is" if out_dir == src else "is inside" if out_dir.is_relative_to(src)
           else "contains" if src.is_relative_to(out_dir) else None)
    if how:
        raise KimiQuantError(f"--output {out_dir} {how} {what} {src}: choose an output directory outside it")


def _run(source: Source, plan: Plan, out_dir: Path, journal: Journal, opts: ConvertOptions, t0: float,
         executor: Executor) -> ConvertResult:
    r = resume_output(source, plan, out_dir, journal, opts)
    entries, made_from, done, todo, unhashed, claimed = r.entries, r.made_from, r.done, r.todo, r.unhashed, r.claimed

    check_window(source.max_disk, todo, entries)
    total = sum(u.in_bytes for u in todo)
    bar = NoBar(total) if opts.quiet or total == 0 else progress_bar(total, f"convert {plan.target}", smoothing=0.1)
    waiting = None
    try:  # the bar is closed whatever happens (a Ctrl-C anywhere); on failure convert() aborts the executor
        waiting = _WaitingBar(bar, executor, staging=source.stages)

        def advance(n: int) -> None:
            waiting.done()
            bar.update(min(n, bar.total - bar.n))  # progress still queued after the end must not pass 100%

        executor.on_progress = advance
        needed = {f for u in todo for f in u.needs}
        source.prefetch([f for f in plan.source_order() if f in needed])

        def shard_done(unit, size: int, sha: str) -> None:
            journal.record_unit(unit.file, size, sha, made_from[unit.file])

        def inputs_hashed(shas: dict[str, str]) -> None:
            for f, sha in shas.items():
                check_claim(source, f, sha, claimed)
                journal.record_input(f, sha, entries[f].stamp)

        # on failure run_shards removes the open shards' .partial files, and convert() aborts the executor
        run_shards(executor, todo, out_dir, source, unhashed=unhashed, on_inputs=inputs_hashed, on_shard=shard_done,
                   part_bytes=opts.part_bytes)
        advance(bar.total - bar.n)  # every unit is done: the last frame (in a log too) says 100%
    finally:
        if waiting is not None:
            waiting.done()
        bar.close()
    finish_output(source, plan, out_dir, journal, opts, r)
    end = time.perf_counter()
    ready = executor.ready_at
    return ConvertResult(plan, out_dir, end - t0, len(todo), len(done), sum(u.in_bytes for u in todo),
                         source.peak_staged_bytes,
                         startup_seconds=(ready - t0) if ready is not None and t0 <= ready <= end else None)


class _WaitingBar:
    """Until the first bytes are done the bar would sit at 0% and 00:00 with no word why: the workers
    load the kernels (~20 s the first time, while they are built) or the first hub shards download.
    Say so, keep the clock ticking on a terminal, and leave the wait out of the bar's rate (else its
    first ETA is hours)."""

    def __init__(self, bar, executor: Executor, staging: bool):
        self.bar = bar
        self.executor = executor
        self.staging = staging
        self._stop = threading.Event()
        if bar.disable:
            self._stop.set()
            return
        from .estimate import kernels_cached

        what = "compiling kernels (first run only, ~20 s)" if kernels_cached() is False else "loading kernels"
        bar.set_postfix_str(what + ("; first shards downloading" if staging else ""))
        if getattr(bar.fp, "isatty", lambda: False)():
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        ready = self.executor.ready
        while not self._stop.wait(0.5):
            if ready is not None and ready.is_set() and "kernels" in self.bar.postfix:
                self.bar.set_postfix_str("first shards downloading" if self.staging else "", refresh=False)
            self.bar.refresh()

    def done(self) -> None:
        """Work has started (the first progress) or ended."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.bar.postfix:
            self.bar.set_postfix_str("", refresh=False)
        if self.bar.n == 0 and hasattr(self.bar, "last_print_t"):
            # tqdm's rate counts from here, the first progress (not the start, nor the kernels being ready):
            # the first tensor's latency (opening shards, a small first tensor) would make the first ETA
            # absurd. A LogBar keeps its own clock.
            self.bar.last_print_t = self.bar._time()
