"""``kimi-quant convert``: the command users run for hours."""

from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path

import click

from ..errors import KimiQuantError, require_torch
from ..executor.fork_server import default_workers, fork_workers_here, start_fork_server
from ..options import old_name, takes_old_name
from ..progress import fmt_size
from .app import main
from .params import (SIZE_UNITS, Size, calib_config, calibration_options, count_noun, fmt_rate, plan_shape_options,
                     check_staging_options)
from .plan_cmd import packed_source_lines


@contextlib.contextmanager
def _collector_paused():
    """No garbage collection inside (as it was after)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@main.command(short_help="Convert a checkpoint (dir or hub repo) for a device.")
@plan_shape_options(output=True)
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Worker processes (default: one per core).")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Run units in local processes or as Ray tasks (pip install kimi-quant[ray]).")
@click.option("--ray-address", help="Ray cluster address (default: start or join a local one).")
@click.option("--overwrite", is_flag=True,
              help="Replace an earlier kimi-quant conversion (other target, recipe or source) in --output. "
                   "A directory of other files is never cleared.")
@click.option("--work-dir", type=click.Path(file_okay=False),
              help="Hub sources: where shards are staged (default: hub/ORG--NAME in the kimi-quant cache: "
                   "$KIMI_QUANT_CACHE, else kimi-quant/ under $HF_HOME, $XDG_CACHE_HOME or ~/.cache).")
@click.option("--max-disk", type=Size(), help=f"Hub sources: most bytes of source shards staged at once ({SIZE_UNITS}) "
              "[default: the two largest source shards, or more if one output shard needs more].")
@click.option("--keep-source", is_flag=True, help="Hub sources: keep staged shards after use.")
@click.option("--validate", "do_validate", is_flag=True, help="Measure perplexity vs BF16 after converting.")
@click.option("--max-ppl-increase", type=float, default=None, metavar="PCT",
              help="With --validate: fail (exit code 3) if quantized perplexity exceeds BF16 by more than PCT "
                   "percent.")
@click.option("--push-to-hub", "push_to", metavar="ORG/NAME", callback=takes_old_name,
              help="Publish the verified output to this hub repo (as `kimi-quant publish --push-to-hub`).")
@old_name("--push-to", "push_to", "--push-to-hub")
@click.option("--hub-revision", metavar="BRANCH", default=None,
              help="With --push-to-hub: upload to this branch (created from main if missing).")
@click.option("--hash-inputs/--no-hash-inputs", default=False, show_default=True,
              help="sha256 every local source shard for the provenance: about as much CPU as the conversion "
                   "itself (~0.55 core-s per GB). Without it the provenance has the sha256 only where a hub "
                   "vouched for it: hub sources, huggingface_hub's cache and --local-dir downloads.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")
@calibration_options
def convert(source, target, recipe, overrides, max_shard_size, revision, group_size, output, workers, executor,
            ray_address, overwrite, work_dir, max_disk, keep_source, do_validate, max_ppl_increase, push_to, hash_inputs,
            quiet, hub_revision=None, calibrate=False, calibration=None, calib_tokens=None, act_order=None, damp=None,
            device="cpu", min_expert_tokens=None, expert_tokens=None, expert_batch=None):
    """Convert SOURCE (a local directory or a hub repo id) for a device family.

    \b
    Examples:
      kimi-quant convert moonshotai/Kimi-K3 -t 950dt -o K3-950dt --max-disk 200GB
      kimi-quant convert /models/Kimi-K3 -t a3 -o K3-a3 --calibrate --workers 16
      kimi-quant convert /models/Kimi-K3 -t a3 -o K3-a3 --calibrate --executor ray --ray-address auto

    Run `kimi-quant plan` with the same arguments first: it reads headers only and says the output size,
    disk, memory and time.

    Re-running the same command after an interruption resumes: completed output shards are
    verified and kept, the rest is redone.

    With --calibrate, each quantized Linear is quantized with GPTQ against the Hessian of its inputs,
    collected by running the BF16 model layer by layer over calibration text (routed experts from the
    tokens routed to them); the output format is the same. It runs layer by layer (resumable per
    layer), each layer's GPTQ problems on --workers local processes or, with --executor ray, as Ray
    tasks (same bytes either way), and needs the source's tokenizer.
    """
    # No collections while the converter loads (numpy, the converter's modules, the fork server's start):
    # what that makes lives to the end anyway, and collecting it as it comes only delays the start-up.
    # gc.freeze() then keeps it out of every later collection.
    with _collector_paused():
        from ..targets import resolve_target

        resolve_target(target)
        check_staging_options(source, revision, work_dir, max_disk, keep_source)
        if not do_validate:
            # numpy's OpenBLAS starts a thread per core that spins for a while once numpy loads (~0.1 core-s a
            # run, taken from the workers); nothing in a plain conversion multiplies matrices (workers: the same),
            # and --calibrate's GPTQ runs on one thread per worker (--workers 1: one core). Before torch, which
            # may load numpy.
            os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        if calibrate or do_validate:
            require_torch("--calibrate" if calibrate else "--validate")
        if max_ppl_increase is not None and not do_validate:
            raise KimiQuantError("--max-ppl-increase applies only with --validate")
        if hub_revision is not None and not push_to:
            raise KimiQuantError("--hub-revision applies only with --push-to-hub")
        if do_validate and not Path(source).expanduser().is_dir():
            raise KimiQuantError("--validate needs the BF16 source as a local directory (hub shards are deleted as "
                                 "they are converted); run `kimi-quant validate BF16_DIR OUTPUT` where both exist")
        if executor == "local" and not calibrate and (workers or default_workers()) > 1 \
                and (do_validate or not fork_workers_here()):
            # workers that cannot be forked from this process (see executor.fork_server; --validate imports
            # torch) come from a fork server: its start-up (python, numpy, the unit code, the kernels) runs
            # while this process imports numpy and plans, and convert's executor finds the server running.
            # A Ctrl-C meanwhile most likely lands in an import: see _forget_caught_interrupt
            start_fork_server()
        from ..convert import ConvertOptions, convert as run_convert

        gc.freeze()  # this process's modules live to its end: its full collections need not walk them
    if do_validate:  # a model validation cannot run is refused before the conversion, not after it
        from ..model.spec import load_model_spec
        from ..runtime.supported import check_supported

        check_supported(load_model_spec(Path(source).expanduser()).text)
    source_options = {}
    if work_dir or max_disk or keep_source:
        source_options = {"work_dir": work_dir, "max_disk": max_disk, "keep_source": keep_source}
    opts = ConvertOptions(target=target, output=Path(output), recipe=recipe, overrides=list(overrides),
                          max_shard_size=max_shard_size, workers=workers, executor=executor,
                          executor_options={"address": ray_address} if ray_address else {},
                          overwrite=overwrite, quiet=quiet, revision=revision, source_options=source_options,
                          hash_inputs=hash_inputs, group_size=group_size,
                          calibrate=calib_config(calibrate, calibration, calib_tokens, act_order, damp, device,
                                                  min_expert_tokens, expert_tokens, expert_batch))
    res = run_convert(source, opts)
    p = res.plan
    if not quiet:
        counts = ", ".join(f"{s} {n}" for s, n in sorted(p.scheme_counts().items()))
        if res.converted_units:
            startup = (f" ({res.startup_seconds:.1f} s of it loading the kernels"
                       + (", compiled on this first run" if res.startup_seconds > 5 else "") + ")"
                       if res.startup_seconds and res.startup_seconds >= 1 else "")
            click.echo(f"done in {res.seconds:.1f} s{startup}: {count_noun(res.converted_units, 'shard')} written"
                       + (f", {res.reused_units} verified and kept" if res.reused_units else "")
                       + f"; {fmt_size(res.in_bytes_done)} in at {fmt_rate(res.in_bytes_done, res.work_seconds)}")
        else:
            click.echo(f"done in {res.seconds:.1f} s: nothing to convert, {count_noun(res.reused_units, 'shard')} "
                       "verified and kept")
        click.echo(f"input {fmt_size(p.in_bytes)} -> output {fmt_size(p.out_bytes)} in {count_noun(len(p.units), 'shard')}; "
                   f"tensors: {counts}")
        for line in packed_source_lines(p, res.calibration is not None):
            click.echo(line.removeprefix("source   ").strip())
        if res.calibration is not None:
            from ..layout.model_card import describe_calibration

            click.echo(f"calibration: {describe_calibration(res.calibration)}")
        if res.peak_staged_bytes is not None:
            click.echo(f"peak staging disk {fmt_size(res.peak_staged_bytes)}")
        click.echo(f"output: {res.out_dir}")
    if do_validate:
        _validate_after(source, res.out_dir, max_ppl_increase, quiet)
    if push_to:
        from ..publish import publish as run_publish

        run_publish(res.out_dir, push_to, branch=hub_revision, echo=lambda m: click.echo(m, err=True))


def _validate_after(source, out_dir, max_ppl_increase, quiet):
    from ..lock import output_lock
    from ..layout.validation import record
    from ..validate.run import format_table, run_validation

    lock = output_lock(out_dir).acquire()  # it writes into the output: no convert there meanwhile
    try:
        report = run_validation(source, out_dir, progress=False)
        if not quiet:
            click.echo(format_table(report))
        record(out_dir, report, max_ppl_increase, source=source if Path(source).expanduser().is_dir() else None)
    finally:
        lock.release()

