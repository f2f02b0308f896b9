"""The output of a conversion, whichever scheduler fills it: where a run starts (``resume_output``: the
source shards, what each output shard is made from, what is still to do), the --max-disk window a run
must fit (``check_window``), and the end (``finish_output``: input hashes, provenance, config, index,
description, card, the journal marked complete). The shard-parallel data-free run (``convert``) and the
layer-sequential calibrated one (``calibrate.run``) both drive it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import KimiQuantError
from .hashing import sha256_files
from .journal import Journal
from .layout.records import read_provenance
from .layout.ascend_v1 import (CARD, DESCRIPTION, INDEX, PROVENANCE, VALIDATION, files_to_copy, output_name,
                               provenance, write_metadata_files)
from .plan import Plan
from .source import Source


@dataclass
class ConvertResult:
    plan: Plan
    out_dir: Path
    seconds: float
    converted_units: int
    reused_units: int
    in_bytes_done: int
    peak_staged_bytes: int | None = None
    calibration: dict | None = None  # calibrated runs: settings, text, tokens and fallback counts
    startup_seconds: float | None = None  # until the kernels were loaded (compiled on a cold numba cache)

    @property
    def work_seconds(self) -> float:
        """The conversion proper: from the kernels being ready to the end."""
        return self.seconds - (self.startup_seconds or 0.0)

    @property
    def gbps(self) -> float:
        return self.in_bytes_done / max(self.work_seconds, 1e-9) / 1e9


def check_window(max_disk: int | None, todo: list, entries: dict) -> None:
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


def carry_validation(out_dir: Path, prov: dict) -> None:
    """A validation report (--validate) stands while no shard was rewritten (``convert`` deletes it
    before rewriting any): keep its summary in the new provenance."""
    old = read_provenance(out_dir)
    if (out_dir / VALIDATION).exists() and "validation" in old:
        prov["validation"] = old["validation"]


def check_claim(source: Source, name: str, sha: str, claimed: dict[str, str]) -> None:
    """A shard hashed with --hash-inputs whose huggingface_hub record named another sha256: the cached file
    is not the hub's (damaged, or the link is a lie); converting it would pass off other weights."""
    if name in claimed and claimed[name] != sha:
        raise KimiQuantError(f"{source.id}/{name}: its content has sha256 {sha}, but huggingface_hub's record (cache "
                             f"link or download metadata) claims {claimed[name]}: the local copy is not the hub's; "
                             "download it again")


@dataclass
class Resume:
    """What a run starts from: the source shards, what each unit is made from, the units still to do."""

    entries: dict
    made_from: dict[str, dict[str, str]]
    done: dict[str, dict]
    todo: list
    unhashed: set[str]
    claimed: dict[str, str]  # local files whose sha256 only a huggingface_hub record claims


def resume_output(source: Source, plan: Plan, out_dir: Path, journal: Journal, opts,
            all_inputs: bool = False) -> Resume:
    """``all_inputs``: every output shard depends on every source shard (a calibrated run: a layer's
    Hessians come from the embedding and every layer before it), so a change to any redoes them all."""
    entries = {f.name: f for f in source.files() if f.name in plan.inputs}
    made_from = {u.file: {f: entries[f].identity for f in (sorted(plan.inputs) if all_inputs else u.needs)}
                 for u in plan.units}
    done = journal.verified_units(out_dir, made_from, quiet=opts.quiet)
    todo = [u for u in plan.units if u.file not in done]
    if todo:  # shards will change: until the run ends the output must not look loadable (nor validated)
        for name in (DESCRIPTION, INDEX, VALIDATION, CARD):  # the card: its numbers are about to be stale
            (out_dir / name).unlink(missing_ok=True)
        journal.reopen()
    claimed = {}  # local files whose sha256 only a huggingface_hub record claims (a blobs/<sha> link, an etag)
    for f in entries.values():
        if f.sha256 and f.mtime_ns is None:  # a hub file: every download is checked against its LFS sha256
            journal.record_input(f.name, f.sha256, f.stamp)
        elif f.sha256:
            claimed[f.name] = f.sha256
    # With --hash-inputs, local shards are hashed by the first unit that reads them; a hash recorded by an earlier run
    # counts only if the file's size and mtime are unchanged (a repaired shard is hashed again).
    unhashed = {f for f in plan.inputs if f not in journal.inputs or journal.input_stamps.get(f) != entries[f].stamp}
    if not opts.hash_inputs:
        unhashed = set()
    return Resume(entries, made_from, done, todo, unhashed, claimed)


def finish_output(source: Source, plan: Plan, out_dir: Path, journal: Journal, opts, r: Resume,
            extra_provenance: dict | None = None) -> None:
    """Hash what is left to hash, then write provenance, config, index and description and mark the journal complete."""
    entries, unhashed, claimed = r.entries, r.unhashed, r.claimed
    late = sorted(unhashed)  # shards whose units were all done by an earlier run
    for f, sha in zip(late, sha256_files([source.fetch(f) for f in late], desc="hash inputs", quiet=opts.quiet)):
        check_claim(source, f, sha, claimed)
        journal.record_input(f, sha, entries[f].stamp)
    # a hash stands only for the file as it is now (without --hash-inputs, shards no hub vouched for: null);
    # a hash huggingface_hub's cache only claims is kept apart, as unverified
    inputs = {}
    for f in sorted(plan.inputs):
        sha = journal.inputs.get(f) if journal.input_stamps.get(f) == entries[f].stamp else None
        inputs[f] = {"size": plan.inputs[f], "sha256": sha}
        if sha is None and f in claimed:
            inputs[f]["sha256_claimed_unverified"] = claimed[f]
    units = {u.file: {k: journal.units[u.file][k] for k in ("size", "sha256")} for u in plan.units}
    prov = provenance(plan, inputs, dict(sorted(units.items())))
    prov.update(extra_provenance or {})
    carry_validation(out_dir, prov)
    copied = files_to_copy(source)  # listed once: the journal names exactly what is written
    around = [INDEX, DESCRIPTION, "config.json", PROVENANCE, CARD, *map(output_name, copied)]
    journal.record_writing(around)  # before writing: an --overwrite after a crash here still knows them
    write_metadata_files(out_dir, plan, source, prov, copied)
    journal.mark_complete([n for n in around if n not in (PROVENANCE, CARD)])  # validate rewrites these
    from .layout.validation import rebind_validation

    rebind_validation(out_dir, journal)  # a carried validation stands only while it measured these very files
