"""``kimi-quant plan``: size a conversion from headers only."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import click

from ..errors import KimiQuantError, require_torch
from ..progress import fmt_duration, fmt_size
from .app import main
from .params import (SIZE_UNITS, Size, calib_config, calibration_options, count_noun, is_local_dir,
                     open_named_source, plan_shape_options, check_staging_options)


@main.command(short_help="Size the job from headers only: output, disk, memory, time, schemes.")
@plan_shape_options
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Workers the memory and time estimates assume (default: one per core; with --executor ray, "
                   "the workers of your cluster).")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Executor the estimates assume (Ray: each worker as fast as one core of this machine).")
@click.option("--driver-cores", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --calibrate: cores of the machine that will drive the run (its forward and Hessians run "
                   "there, and --executor local workers too), when that is not this one; rates stay this machine's "
                   "per core. Example: --executor ray --workers 1024 --driver-cores 64 for 16 nodes of 64 cores.")
@click.option("--work-dir", type=click.Path(file_okay=False), help="Hub sources: where shards would be staged.")
@click.option("--max-disk", type=Size(), help=f"Hub sources: most bytes of source shards staged at once ({SIZE_UNITS}) "
              "[default: the two largest source shards, or more if one output shard needs more].")
@click.option("--link-gbps", type=click.FloatRange(min=0, min_open=True),
              help="Hub sources: the download link in GB/s; the time is then the longer of converting and "
                   "downloading (with many workers, or Ray nodes, the link is the limit).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write the plan as JSON, with the estimates under 'totals'.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing (with --json: only the file).")
@click.option("--shards/--no-shards", "show_shards", default=False, help="List the output shards and their inputs.")
@click.option("--verbose", "-v", is_flag=True, help="Scheme table and the shard list as well.")
@click.option("--remeasure", is_flag=True, help="Measure this machine's codec rates again (else the stored ones).")
@calibration_options
def plan(source, target, recipe, overrides, max_shard_size, revision, group_size, workers, executor, driver_cores,
         work_dir, max_disk,
         link_gbps, json_path, show_shards, verbose, remeasure, quiet=False, calibrate=False, calibration=None,
         calib_tokens=None, act_order=None, damp=None, device="cpu", min_expert_tokens=None, expert_tokens=None,
         expert_batch=None):
    """Size a conversion before running it, from headers only (no tensor data is read): output size,
    disk needed, peak memory and wall time for the given --workers/--executor, model_quant_type, and
    (-v) the scheme of every tensor group and the output shards.

    The time comes from this machine's codec rates, measured once (about a second) and stored in
    the kimi-quant cache (KIMI_QUANT_CACHE); --remeasure takes them again.

    With --calibrate (and --tokens), also the time and memory a calibrated conversion needs,
    from GPTQ and matmul speeds measured here (a few seconds) and the model's shapes.
    """
    from ..convert import build_plan
    from ..estimate import load_rates, size_job

    if quiet and (verbose or show_shards):
        raise KimiQuantError(f"--quiet prints nothing: drop it or {'--verbose' if verbose else '--shards'}")
    if driver_cores is not None and not calibrate:
        raise KimiQuantError("--driver-cores sizes a calibrated run: add --calibrate, or drop it")
    if calibrate:
        require_torch("plan --calibrate (it measures this machine's GPTQ and forward rates)")
    cal = calib_config(calibrate, calibration, calib_tokens, act_order, damp, device, min_expert_tokens,
                       expert_tokens, expert_batch, need_device=False)
    check_staging_options(source, revision, work_dir, max_disk, link_gbps=link_gbps)
    hub = not is_local_dir(source)
    src = open_named_source(source, revision, work_dir if hub else None)
    try:
        p = build_plan(src, target, recipe, overrides, max_shard_size, group_size, calibrated=cal is not None)
        if cal is not None:
            from ..model.spec import load_model_spec_from_source

            spec = load_model_spec_from_source(src, recipe_given=True)
            if spec.text is None:
                raise KimiQuantError("--calibrate runs the Kimi K3-family forward; this model is not one")
    finally:
        src.close()
    workers = workers or driver_cores or os.cpu_count() or 1
    if json_path:  # an unwritable path fails before anything is measured or printed
        parent = Path(json_path).expanduser().parent
        why = (errno.ENOENT if not parent.is_dir() else errno.EACCES if not os.access(parent, os.W_OK) else None)
        if why is not None:
            raise KimiQuantError(f"{json_path}: cannot write the plan ({os.strerror(why)})")
    rates = load_rates(remeasure, on_measure=lambda: click.echo(
        "measuring this machine's codec rates (once; the kernels are compiled first if they never were)",
        err=True))
    job = size_job(p, rates, workers=workers, executor=executor, hub=hub, max_disk=max_disk if hub else None,
                   link_bps=link_gbps * 1e9 if link_gbps and hub else None)
    counts = p.scheme_counts()
    in_by, out_by = {}, {}
    for t in p.tensors():
        in_by[t.scheme] = in_by.get(t.scheme, 0) + t.in_bytes
        out_by[t.scheme] = out_by.get(t.scheme, 0) + t.out_bytes
    cal_lines, cal_est = [], None
    if cal is not None:
        from ..calibrate.estimate import estimate

        cal_est = estimate(p, spec, cal, workers, executor, driver_cores=driver_cores)
        cal_lines = _calibrate_lines(cal_est, cal)
    if json_path:  # first: an unwritable path fails before any of the plan is printed
        from ..write import write_atomic

        d = p.to_json()
        d["totals"] = {**job, "tensors": sum(counts.values()), "model_quant_type": p.description()["model_quant_type"],
                       "schemes": {s: {"tensors": counts[s], "in_bytes": in_by[s], "out_bytes": out_by[s]}
                                   for s in sorted(counts)}}
        if cal_est is not None:
            d["totals"]["calibrate"] = cal_est
        try:
            write_atomic(json_path, json.dumps(d, indent=1).encode())
        except OSError as e:
            raise KimiQuantError(f"{json_path}: cannot write the plan ({e.strerror or e})") from None
    if quiet:
        return
    for line in [*plan_lines(p, job, work_dir=src.work_dir, calibrated=cal is not None), *cal_lines]:
        click.echo(line)
    if verbose or show_shards:
        click.echo(f"\n{'scheme':14s} {'tensors':>8s} {'in':>12s} {'out':>12s}")
        for s in sorted(counts):
            click.echo(f"{s:14s} {counts[s]:8d} {fmt_size(in_by[s]):>12s} {fmt_size(out_by[s]):>12s}")
        click.echo(f"{'total':14s} {sum(counts.values()):8d} {fmt_size(p.in_bytes):>12s} {fmt_size(p.out_bytes):>12s}")
        click.echo("")
        for u in p.units:
            needs = ", ".join(u.needs[:3]) + (f" (+{len(u.needs) - 3})" if len(u.needs) > 3 else "")
            click.echo(f"  {u.file}  {len(u.tensors):6d} tensors  {fmt_size(u.out_bytes):>10s}  <- {needs}")
    else:
        click.echo("(-v: tensors per scheme and the output shard list)")
    if json_path:
        click.echo(f"plan written to {json_path}")


def _expert_tokens(e: dict) -> str:
    """What a routed expert's Hessian will see: the run's stats give the min / median it did see."""
    if not e["expert_tokens_mean"]:
        return ""
    if e["expert_tokens"] == "all":
        return f", every routed expert's Hessian from all of them (min = median = {e['expert_tokens_mean']:.0f})"
    return (f", ~{e['expert_tokens_mean']:.0f} per routed expert on average (routed: the median is about that "
            "with balanced routing, the min lower; the run reports both; --expert-tokens all gives every expert all)")


def _all_token_line(e: dict) -> list[str]:
    """The all-token pass of under-routed MXFP4 experts (a3 from a packed source, per-channel int4)."""
    if not e["all_token_experts"]:
        return []
    n = e["under_routed_share"] * e["all_token_experts"]
    return [f"         MXFP4 experts under --min-expert-tokens are calibrated on every token: ~{n:.0f} of "
            f"{e['all_token_experts']} with balanced routing (counted above); a skewed router sends more, at most "
            f"+{fmt_duration(e['all_token_worst_s'])} if every one were"]


def _calibrate_lines(e: dict, cal) -> list[str]:
    """plan --calibrate: the calibrated conversion's time and memory (calibrate/estimate.py)."""
    where = (f"{e['workers']} Ray workers" if e["executor"] == "ray" else
             f"{e['workers']} local workers" + (f" (capped at {e['gptq_workers']} cores)"
                                                if e["gptq_workers"] < e["workers"] else ""))
    d = e["driver_memory"]
    return [f"calibrate ~{fmt_duration(e['wall_seconds'])} on {where}: start-up {fmt_duration(e['startup_s'])}, "
            f"forward {fmt_duration(e['forward_s'])} + Hessians {fmt_duration(e['hessian_s'])} (layer by layer between the GPTQ stages, "
            + (f"on the driver's {e['driver_threads']} threads" if e["forward_partitions"] <= 1 else
               f"data-parallel: each of {e['forward_partitions']} passes in a Ray actor of {e['driver_threads']} threads")
            + f"), GPTQ {fmt_duration(e['gptq_s'])} (each stage's jobs spread over the "
            f"workers, at most {e['max_parallel_jobs']} at once; a routed expert is one job that forms its own "
            f"Hessians, --expert-batch {e['experts_per_stage']} of them per stage); {cal.tokens} tokens" + _expert_tokens(e),
            f"         measured here: fp32 {e['fp32_gflops']:.0f} GFLOP/s per core, {e['op_us']:.0f} us per torch op; "
            "GPTQ per routed-expert matrix " + ", ".join(f"{k} {v:.3g} s" for k, v in e["gptq_s_per_expert_matrix"].items())
            + f"; {fmt_duration(e['core_hours'] * 3600)} of one core in all",
            *_all_token_line(e),
            f"         memory ~{fmt_size(e['worker_memory_bytes'])} per worker (its largest GPTQ job, "
            f"[{e['worker_memory_tensor_shape'][0]}, {e['worker_memory_tensor_shape'][1]}]), "
            f"~{fmt_size(e['driver_memory_bytes'])} driver ("
            + (f"state of {cal.tokens} tokens" if e["forward_partitions"] <= 1 else "state of one pass at a time")
            + f" {fmt_size(d['state'])}, forward "
            f"{fmt_size(d['forward'])}, Hessians {fmt_size(d['hessians'])}, weights {fmt_size(d['weights'])}, jobs "
            f"handed out {fmt_size(d['jobs'])}"
            + (f", a layer's routed experts as written for the forward actors {fmt_size(d['written_experts'])}"
               if d.get("written_experts") else "") + ")"
            + (f", ~{fmt_size(e['memory_bytes'])} peak on this machine" if e["executor"] == "local" else "")
            + (f", ~{fmt_size(e['partition_memory_bytes'])} per forward actor (its pass's state and forward, a layer's "
               "weights and its routed experts as written)" if e["forward_partitions"] > 1 else "")
            + _over_memory(e)
            + "; shards are cut at layer boundaries"] + _device_lines(e)


def _over_memory(e: dict) -> str:
    """A local run past this machine's memory: convert refuses it (or gives it fewer default workers) up front."""
    from ..calibrate.estimate import machine_memory_bytes

    have = machine_memory_bytes()
    if e["executor"] != "local" or e["driver_cores"] or e["memory_bytes"] <= have:
        return ""
    return (f" (more than this machine's {fmt_size(have)}: convert refuses such a run, or runs fewer workers when "
            "--workers is not given)")


def _device_lines(e: dict) -> list[str]:
    """With --device cuda|npu: the times above are CPU estimates; what the device holds."""
    from ..calibrate.estimate import DEVICE_CONTEXT_BYTES

    if e["device"] == "cpu":
        return []
    return [f"         --device {e['device']}: the forward, Hessians and GPTQ times above are CPU estimates (this "
            f"machine's CPU rates; no {e['device']} rate is measured); on the device: "
            f"~{fmt_size(e['device_memory_bytes'])} (the driver's weights, state, forward and Hessians"
            + (", and its local workers' GPTQ jobs" if e["executor"] == "local" else "")
            + "; convert checks it against the device's free memory)"
            + ("" if e["executor"] == "local" else
               f"; each Ray task holds up to ~{fmt_size(e['worker_memory_bytes'] + DEVICE_CONTEXT_BYTES)} on the "
               f"device it shares (its job and a context), and Ray puts ceil({e['workers']} / the cluster's "
               "devices) tasks on each")]


def packed_source_lines(p, calibrated: bool) -> list[str]:
    """What becomes of a source's packed MXFP4 tensors, and on a3 the measured rule its experts follow
    (nothing for a BF16 source)."""
    from ..plan import packed_words

    summary = p.packed_summary
    if not summary:
        return []
    rule = p.mxfp4_experts_line(calibrated)
    return [f"source   {packed_words(summary)}", *([f"         {rule}"] if rule else [])]


def plan_lines(p, job: dict, work_dir=None, calibrated: bool = False) -> list[str]:
    """The sizing lines ``plan`` prints first: what is converted, output, disk, memory, time, model_quant_type."""
    from ..plan import PER_GROUP_LOADERS, model_quant_type_meaning

    lines = [f"plan     {p.source}" + (f" @ {p.revision}" if p.revision else "")
             + f" -> {p.target} (recipe {p.recipe['name']}"
             + (f", int4 per group of {p.int4_group_size}" if p.int4_group_size else "")
             + f"): {count_noun(job['units'], 'output shard')} (max {fmt_size(p.max_shard_size)})",
             f"output   {fmt_size(job['out_bytes'])} ({job['out_bytes'] / max(job['in_bytes'], 1):.1%} of "
             f"{fmt_size(job['in_bytes'])} {'MXFP4 + BF16' if p.packed_summary else 'BF16'} input)"]
    lines += packed_source_lines(p, calibrated)
    if job["disk_staging_bytes"] is None:
        lines.append(f"disk     {fmt_size(job['disk_needed_bytes'])}: the output (a local source is read in place)")
    else:
        free = ""
        if work_dir is not None:
            import shutil

            probe = Path(work_dir)
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            try:
                free = f"; {fmt_size(shutil.disk_usage(probe).free)} free at {probe}"
            except OSError:
                pass
        lines.append(f"disk     {fmt_size(job['disk_needed_bytes'])}: the output + a staging window of "
                     f"{fmt_size(job['disk_staging_bytes'])} in --work-dir {work_dir}{free}")
        window = (f"--max-disk is below the {fmt_size(job['min_max_disk_bytes'])} one output shard needs at once: "
                  "convert would refuse it" if job["max_disk_too_small"] else
                  f"--max-disk at least {fmt_size(job['min_max_disk_bytes'])} (the source shards of the largest "
                  "output shard)")
        lines.append(f"         {window}")
    if job["executor"] == "local":
        lines.append(f"memory   ~{fmt_size(job['memory_peak_bytes'])} peak: the driver + {job['workers']} workers x "
                     f"{fmt_size(job['memory_per_worker_bytes'])} (largest quantized tensor in + out, buffers)")
    else:
        lines.append(f"memory   ~{fmt_size(job['memory_peak_bytes'])} for the driver; each Ray worker "
                     f"~{fmt_size(job['memory_per_worker_bytes'])} on top of Ray's own")
    if "wall_seconds" in job:
        who = (count_noun(job['parallel'], 'local worker') if job["executor"] == "local"
               else f"{job['parallel']} Ray workers, each as fast as one core here")
        lines.append(f"time     ~{fmt_duration(job['wall_seconds'])} on {who} ({fmt_duration(job['core_seconds'])} of "
                     f"one core at this machine's codec rates, ~{job['rate_gbps']:.2f} GB/s)")
        if job.get("compile_seconds"):
            lines.append(f"         + ~{fmt_duration(job['compile_seconds'])} compiling the kernels (first run only)")
        if job.get("calibrate_seconds"):
            lines.append(f"         incl. ~{fmt_duration(job['calibrate_seconds'])} for --calibrate")
        if job["download_bytes"] and job.get("link_gbps"):
            limit = "the link is the limit" if job["limit"] == "download" else "converting is the limit"
            lines.append(f"         downloading {fmt_size(job['download_bytes'])} at {job['link_gbps']:g} GB/s overlaps "
                         f"with converting: {limit}")
        elif job["download_bytes"]:
            lines.append(f"         + downloading {fmt_size(job['download_bytes'])}, overlapped with converting "
                         f"(alone at 1 GB/s: {fmt_duration(job['download_bytes'] / 1e9)}; --link-gbps counts it)")
    kernels = job.get("kernels") or {}
    if kernels.get("build") == "jit" and job["executor"] == "local":
        lines.append(f"kernels  numba's JIT (same bytes, ~0.7 s more start-up per run): the compiled kernels are "
                     f"not used ({kernels['why']}); delete {kernels['retry']} to build them again")
    lines.append("quant    " + model_quant_type_meaning(p.description()["model_quant_type"], set(p.scheme_counts())))
    if p.int4_group_size:
        lines.append(f"loaders  {PER_GROUP_LOADERS}: --group-size 0 writes what all of them load")
    return lines

