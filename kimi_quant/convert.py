"""The conversion driver: source -> plan -> executor (units) -> journal -> metadata files.

The driver alone owns the output directory's journal, index, description and provenance;
executors only write output shards. Every step is resumable: re-running the same command
after a crash redoes only what the journal does not vouch for.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from pathlib import Path

from .errors import KimiQuantError
from .executor import make_executor
from .hashing import sha256_files
from .journal import Journal, check_same_conversion
from .layout.ascend_v1 import (DESCRIPTION, INDEX, OWN_FILES, PROVENANCE, VALIDATION, files_to_copy, provenance,
                               write_metadata_files)
from .model.spec import load_model_spec_from_source
from .plan import DEFAULT_MAX_SHARD_SIZE, Plan, make_plan
from .recipe import load_recipe
from .source import Source, open_source
from .targets import resolve_target


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


@dataclass
class ConvertResult:
    plan: Plan
    out_dir: Path
    seconds: float
    converted_units: int
    reused_units: int
    in_bytes_done: int
    peak_staged_bytes: int | None = None

    @property
    def gbps(self) -> float:
        return self.in_bytes_done / max(self.seconds, 1e-9) / 1e9


def build_plan(source: Source, target_name: str, recipe_path=None, overrides=(), max_shard_size=DEFAULT_MAX_SHARD_SIZE):
    target = resolve_target(target_name)
    spec = load_model_spec_from_source(source, recipe_given=recipe_path is not None)
    recipe = load_recipe(target.name, recipe_path, list(overrides))
    return make_plan(source, spec, recipe, target, max_shard_size)


def _plan_summary(plan: Plan) -> dict:
    return {"target": plan.target, "revision": plan.revision, "recipe": plan.recipe.get("name"),
            "recipe_sha256": plan.recipe.get("sha256"), "tool_version": plan.tool_version}


def prepare_output(out_dir: Path, plan: Plan, overwrite: bool) -> Journal:
    """Open (or start) the journal, refusing to mix two conversions in one directory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    journal = Journal(out_dir)
    summary = _plan_summary(plan)
    fingerprint = plan.fingerprint()
    # A journal torn before its first line was complete (and stale .partial files) mean a kimi-quant
    # run died at its very start: not someone else's files.
    others = sorted(p.name for p in out_dir.iterdir() if p.name != journal.path.name and p.suffix != ".partial")
    if journal.start is None and others:  # never cleared, even with --overwrite: it may be anyone's directory
        raise KimiQuantError(f"{out_dir} is not empty (it holds {others[0]!r}{' and more' if len(others) > 1 else ''}) "
                             "and is not a kimi-quant output; choose an empty or new --output "
                             "(--overwrite only replaces an earlier kimi-quant output)")
    differs = journal.start is not None and journal.start.get("fingerprint") != fingerprint
    if differs and not overwrite:
        check_same_conversion(journal, fingerprint, summary, out_dir)
    if differs and overwrite:
        _clear_output(out_dir)
        journal = Journal(out_dir)
    for stale in out_dir.rglob("*.partial"):  # copied files may live in subdirectories
        stale.unlink()
    if journal.start is None:
        journal.begin(fingerprint, summary)
    return journal


def _clear_output(out_dir: Path) -> None:
    for p in out_dir.iterdir():
        if p.name.startswith(("quant_model_", "kimi_quant_")) or p.name in OWN_FILES or p.suffix == ".partial":
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def convert(source_spec: str, opts: ConvertOptions) -> ConvertResult:
    t0 = time.perf_counter()
    target = resolve_target(opts.target)  # refuse unsupported targets before touching anything
    executor = source = None
    ok = False
    try:
        if opts.executor == "local":  # workers start now and load the kernels while the driver plans
            executor = make_executor("local", opts.workers, None)
            executor.start()  # held before it starts: a Ctrl-C meanwhile still reaches shutdown below
        source = open_source(source_spec, revision=opts.revision, **opts.source_options)
        out_dir = Path(opts.output).resolve()
        _refuse_overlap(getattr(source, "root", None), out_dir, "the source directory")
        _refuse_overlap(getattr(source, "work_dir", None), out_dir, "the hub staging directory (--work-dir)")
        plan = build_plan(source, target.name, opts.recipe, opts.overrides, opts.max_shard_size)
        journal = prepare_output(out_dir, plan, opts.overwrite)
        executor = executor or make_executor(opts.executor, opts.workers, None, **opts.executor_options)  # Ray: now
        result = _run(source, plan, out_dir, journal, opts, t0, executor)
        ok = True
        return result
    finally:
        if executor is not None:
            executor.shutdown(abort=not ok)
        if source is not None:
            source.close()


def _check_window(max_disk: int | None, todo: list, entries: dict) -> None:
    """--max-disk must hold every source shard of one output shard at once, or that bound cannot be kept."""
    if max_disk is None or not todo:
        return
    size = {u.file: sum(entries[f].size for f in u.needs) for u in todo}
    unit = max(todo, key=lambda u: size[u.file])
    need = size[unit.file]
    if need > max_disk:
        raise KimiQuantError(f"--max-disk {max_disk} bytes is less than output shard {unit.file} needs at once "
                             f"(its {len(unit.needs)} source shards: {need} bytes); raise --max-disk to at least "
                             "that, or lower --max-shard-size")


def _carry_validation(out_dir: Path, prov: dict) -> None:
    """A validation report (--validate) stands while no shard was rewritten (``_run`` deletes it
    before rewriting any): keep its summary in the new provenance."""
    try:
        old = json.loads((out_dir / PROVENANCE).read_text())
    except (OSError, ValueError):
        return
    if (out_dir / VALIDATION).exists() and isinstance(old, dict) and "validation" in old:
        prov["validation"] = old["validation"]


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
         executor) -> ConvertResult:
    entries = {f.name: f for f in source.files() if f.name in plan.inputs}
    made_from = {u.file: {f: entries[f].identity for f in u.needs} for u in plan.units}
    done = journal.verified_units(out_dir, made_from, quiet=opts.quiet)
    todo = [u for u in plan.units if u.file not in done]
    if todo:  # shards will change: until the run ends the output must not look loadable (nor validated)
        for name in (DESCRIPTION, INDEX, VALIDATION):
            (out_dir / name).unlink(missing_ok=True)
        journal.reopen()
    for f in entries.values():
        if f.sha256:  # the hub's LFS sha256 (verified on download, or recorded by huggingface_hub): not hashed here
            journal.record_input(f.name, f.sha256, f.stamp)
    # With --hash-inputs, local shards are hashed by the first unit that reads them; a hash recorded by an earlier run
    # counts only if the file's size and mtime are unchanged (a repaired shard is hashed again).
    unhashed = {f for f in plan.inputs if f not in journal.inputs or journal.input_stamps.get(f) != entries[f].stamp}
    if not opts.hash_inputs:
        unhashed = set()

    from tqdm import tqdm

    _check_window(getattr(source, "max_disk", None), todo, entries)
    total = sum(u.in_bytes for u in todo)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=f"convert {plan.target}",
               disable=opts.quiet or total == 0, dynamic_ncols=True, smoothing=0.1)
    # Until the first bytes are done the bar would sit at 0% with no word why (workers loading the
    # kernels: ~20 s the first time, while numba compiles them; or the first hub shard downloading).
    bar.set_postfix_str("starting: workers load the kernels (compiled on the first run)"
                        + ("; first shards downloading" if getattr(source, "can_stage", None) else ""))

    def advance(n: int) -> None:
        if bar.postfix:
            bar.set_postfix_str("", refresh=False)
        bar.update(n)

    executor.on_progress = advance
    users = Counter(f for u in todo for f in u.needs)
    source.prefetch([f for f in plan.source_order() if users[f]])
    pending = deque(todo)
    can_stage = getattr(source, "can_stage", lambda names: True)
    inflight = {}
    try:  # on failure convert() aborts the executor (running units leave only .partial files)
        while pending or inflight:
            while pending and len(inflight) < executor.slots:
                if inflight and not can_stage(pending[0].needs):
                    break  # its shards would overflow the staging window: wait for running units to release theirs
                unit = pending.popleft()
                paths = {f: str(source.fetch(f)) for f in unit.needs}
                job = unit.to_json()
                job["hash_inputs"] = sorted(unhashed.intersection(unit.needs))
                unhashed.difference_update(job["hash_inputs"])
                inflight[executor.submit(job, paths, str(out_dir))] = unit
            finished, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
            for fut in finished:
                unit = inflight.pop(fut)
                res = fut.result()
                for f, sha in (res.get("inputs") or {}).items():
                    journal.record_input(f, sha, entries[f].stamp)
                journal.record_unit(res["file"], res["size"], res["sha256"], made_from[unit.file])
                for f in unit.needs:
                    users[f] -= 1
                    if users[f] == 0:
                        source.release(f)
    finally:
        bar.close()
    late = sorted(unhashed)  # shards whose units were all done by an earlier run
    for f, sha in zip(late, sha256_files([source.fetch(f) for f in late], desc="hash inputs", quiet=opts.quiet)):
        journal.record_input(f, sha, entries[f].stamp)
    # a hash stands only for the file as it is now (without --hash-inputs, shards no hub vouched for: null)
    inputs = {f: {"size": plan.inputs[f],
                  "sha256": journal.inputs.get(f) if journal.input_stamps.get(f) == entries[f].stamp else None}
              for f in sorted(plan.inputs)}
    units = {u.file: {k: journal.units[u.file][k] for k in ("size", "sha256")} for u in plan.units}
    prov = provenance(plan, inputs, dict(sorted(units.items())))
    _carry_validation(out_dir, prov)
    write_metadata_files(out_dir, plan, source, prov)
    journal.mark_complete([INDEX, DESCRIPTION, "config.json", *files_to_copy(source)])
    return ConvertResult(plan, out_dir, time.perf_counter() - t0, len(todo), len(done),
                         sum(u.in_bytes for u in todo), getattr(source, "peak_staged_bytes", None))
