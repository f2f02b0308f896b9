"""The ``kimi-quant`` command line.

Every user-caused failure is one line on stderr and a non-zero exit; ``--debug`` (or
KIMI_QUANT_DEBUG=1) shows the traceback as well.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import re
import signal
import sys
import traceback
from pathlib import Path

import click

from . import __version__
from .errors import KimiQuantError, ValidationFailed, require_torch
from .executor.fork_server import default_workers, fork_workers_here, start_fork_server
from .options import old_name, takes_old_name
from .progress import SIZE_SUFFIXES, fmt_duration, fmt_size

def parse_size(text: str) -> int:
    """'4GiB', '500MB', '2g', '123' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in SIZE_SUFFIXES:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 4GiB, 500MB)")
    return int(float(m.group(1)) * SIZE_SUFFIXES[m.group(2).lower()])


class Size(click.ParamType):
    name = "SIZE"

    def __init__(self, minimum: int = 1):
        self.minimum = minimum

    def convert(self, value, param, ctx):
        n = value if isinstance(value, int) else parse_size(value)
        if n < self.minimum:
            self.fail(f"{value!r} is below the minimum of {self.minimum:,} bytes", param, ctx)
        return n


SIZE_UNITS = "KB/MB/GB = 10^3/10^6/10^9 bytes, KiB/MiB/GiB = 2^10/2^20/2^30"
# Below this an output shard holds a tensor or two and the index lists thousands of files: a typo.
MIN_SHARD_SIZE = 64 * 1024


def _count(n: int, noun: str) -> str:
    """``1 shard``, ``2 shards``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _gb(n: int | float) -> str:
    return fmt_size(n)


def _rate(n: int, seconds: float) -> str:
    """Bytes per second in GB/s, or MB/s / kB/s where GB/s would read 0.00."""
    r = n / max(seconds, 1e-9)
    return f"{r / 1e9:.2f} GB/s" if r >= 1e8 else f"{r / 1e6:.2f} MB/s" if r >= 1e5 else f"{r / 1e3:.1f} kB/s"


def _os_message(e: OSError) -> str:
    """'PATH: reason' (as the shell says it) for an OSError the user can fix: read-only, missing, full disk."""
    reason = e.strerror or str(e)
    if e.filename is None:
        return reason
    return f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 is not None else "") + f": {reason}"


class _Group(click.Group):
    def parse_args(self, ctx, args):
        # --debug is accepted anywhere on the line (kimi-quant convert ... --debug), not only before the command
        end = args.index("--") if "--" in args else len(args)
        if "--debug" in args[:end] and args[:1] != ["--debug"]:
            args = [a for i, a in enumerate(args) if not (a == "--debug" and i < end)]
            ctx.meta["kq_debug"] = True
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            return self._invoke(ctx)
        finally:
            _forget_caught_interrupt()  # the exit status is the one chosen here

    def _invoke(self, ctx):
        # Subcommands parse their options inside Group.invoke, so bad option values land here as well.
        try:
            return super().invoke(ctx)
        except KimiQuantError as e:
            self._fail(ctx, str(e), e.exit_code)
        except click.UsageError as e:
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            self._fail(ctx, e.format_message() + where, 2)
        except click.ClickException as e:
            self._fail(ctx, e.format_message(), 2)
        except BrokenPipeError:  # the reader left (``| head -1``): nothing to say, as any filter would
            _quiet_broken_pipe()
        except OSError as e:  # unwritable or missing paths: the user's to fix, not a bug
            self._fail(ctx, _os_message(e), 2)
        except KeyboardInterrupt as e:
            if not getattr(e, "reported", False):  # convert says it the moment it happens
                resumable = ctx.invoked_subcommand in ("convert", "demo")
                click.echo("kimi-quant: interrupted" + ("; re-run the same command to resume" if resumable else ""),
                           err=True)
            sys.exit(130)

    @staticmethod
    def _fail(ctx, message: str, code: int):
        if ctx.obj and ctx.obj.get("debug"):
            traceback.print_exc()  # called from an except block: the exception being handled
        click.echo(f"kimi-quant: error: {message}", err=True)
        sys.exit(code)


def _quiet_broken_pipe() -> None:
    """Exit as a process killed by SIGPIPE would (128 + 13), with stdout pointed at /dev/null so that the
    interpreter's final flush into the closed pipe says nothing either."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    sys.exit(128 + signal.SIGPIPE)


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


def _forget_caught_interrupt() -> None:
    """Keep the exit status the CLI chose (130 after a Ctrl-C) when the KeyboardInterrupt was raised inside
    code that ``exec``/``eval`` ran from a string, as every dataclass and namedtuple definition does (so an
    import is often in such code when Ctrl-C lands). CPython then sets its "unhandled KeyboardInterrupt"
    flag (``run_eval_code_obj``) although the exception is caught further up, and under ``python -m``
    (``pymain_run_module`` returns the exit status instead of exiting on SystemExit) it checks the flag
    after finalizing and kills itself with SIGINT: returncode -2 instead of 130, or instead of whatever a
    handled run exits with. (The ``kimi-quant`` script exits on SystemExit before that check.) Each run
    of a string clears the flag as it starts, so an empty one that completes leaves it clear (CPython
    3.11-3.13 checked: tests/test_cli_errors.py::test_ctrl_c_in_exec_code_exits_130)."""
    exec("")  # noqa: S102 - a constant, empty program: its only effect is the reset


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kimi-quant")
@click.option("--debug", is_flag=True, envvar="KIMI_QUANT_DEBUG",
              help="Show tracebacks on errors (before or after the command, or KIMI_QUANT_DEBUG=1).")
@click.pass_context
def main(ctx, debug):
    """Convert BF16 Kimi K3 / K3.1 checkpoints into Ascend ascendV1 quantized checkpoints.

    \b
    Typical use:
      kimi-quant targets                                   # device families and their schemes
      kimi-quant synth --preset tiny --output tiny-bf16    # a small K3.1-shaped checkpoint
      kimi-quant plan tiny-bf16 --target 950dt             # dry run from headers only
      kimi-quant convert tiny-bf16 --target 950dt --output tiny-950dt
      kimi-quant verify tiny-950dt
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug or ctx.meta.get("kq_debug", False)


# -- targets ---------------------------------------------------------------------------------
@main.command(short_help="List device families, their schemes and status.")
def targets():
    """List the device families (--target values), their schemes and status."""
    from .targets import TARGETS

    for t in TARGETS.values():
        status = "supported" if t.supported else "not yet supported"
        click.echo(f"{t.name:7s} {status:18s} {t.hardware}")
        if t.supported:
            click.echo(f"{'':26s} {t.scheme}")
    click.echo("\nAliases such as A3, atlas-a3, 800i-a3, 950DT, ascend-950dt are accepted.")


# -- shared options ----------------------------------------------------------------------------
def _plan_options(f=None, *, output: bool = False):
    """SOURCE, -t and the options that shape the plan; ``output=True`` puts -o right after -t (convert)."""
    if f is None:
        return lambda g: _plan_options(g, output=output)
    decos = [
        click.argument("source"),
        click.option("--target", "-t", required=True, help="Device family: a3 (W4A8 int) or 950dt (W4A8 MXFP)."),
    ]
    if output:
        decos.append(click.option("--output", "-o", required=True, type=click.Path(file_okay=False),
                                  help="Output directory (re-run the same command to resume into it)."))
    decos += [
        click.option("--recipe", type=click.Path(dir_okay=False), help="Recipe TOML replacing the built-in one."),
        click.option("--override", "overrides", multiple=True, metavar="PATTERN=SCHEME",
                     help="Set the scheme of tensors matching a glob, e.g. '*.layers.3.*=FLOAT' (it must match some "
                          "tensor; the scheme must be one the --target runs). Repeatable."),
        click.option("--max-shard-size", type=Size(MIN_SHARD_SIZE), default="4GiB", show_default=True,
                     help=f"Largest output shard, at least 64KiB ({SIZE_UNITS})."),
        click.option("--revision", help="Hub branch, tag or commit (resolved to a commit sha once)."),
        click.option("--group-size", type=click.IntRange(min=0), default=None, metavar="G",
                     help="a3: per-group int4 routed experts, one scale per G inputs (32, 64, 128, 256). Better "
                          "quality, but only vLLM-Ascend 0.23.x reads it (docs/formats-and-consumers.md). "
                          "0 = per output channel, which every loader reads [default: the recipe's, else 0]."),
    ]
    for deco in reversed(decos):
        f = deco(f)
    return f


def _open(source, revision, work_dir=None):
    from .source import open_source

    return open_source(source, revision=revision, work_dir=work_dir)


def _calibrate_options(f):
    from .calibrate.config import DEFAULT_MIN_EXPERT_TOKENS, DEFAULT_TEXT, DEFAULT_TOKENS, GPTQ_DEFAULTS

    for deco in reversed([
        click.option("--calibrate", is_flag=True,
                     help="Activation-aware quantization (GPTQ): run the BF16 model layer by layer over calibration "
                          "text and quantize each Linear against its input Hessian. Same output format."),
        click.option("--calibration-data", "calibration", metavar="FILE|NAME", default=None, callback=takes_old_name,
                     help=f"With --calibrate: GPTQ's text, a jsonl ('text' field), txt or parquet file, or "
                          f"builtin:train / builtin:heldout [default: {DEFAULT_TEXT}]."),
        old_name("--calibration", "calibration", "--calibration-data"),
        click.option("--tokens", "calib_tokens", type=click.IntRange(min=1), default=None, metavar="N",
                     callback=takes_old_name,
                     help=f"With --calibrate: tokens of calibration text [default: {DEFAULT_TOKENS}]."),
        old_name("--calib-tokens", "calib_tokens", "--tokens", type=click.IntRange(min=1)),
        click.option("--act-order/--no-act-order", "act_order", default=None,
                     help="With --calibrate: GPTQ columns in order of decreasing Hessian diagonal "
                          f"[default: {'on' if GPTQ_DEFAULTS['act_order'] else 'off'}]."),
        click.option("--damp", type=click.FloatRange(min=0, max=1, min_open=True), default=None, metavar="FRAC",
                     help="With --calibrate: GPTQ dampening, a fraction of the mean Hessian diagonal added to it "
                          f"[default: {GPTQ_DEFAULTS['damp']}]."),
        click.option("--device", type=click.Choice(["cpu", "cuda", "npu"]), default="cpu", show_default=True,
                     help="With --calibrate: where GPTQ runs (cuda / npu where torch has them)."),
        click.option("--min-expert-tokens", type=click.IntRange(min=1), default=None, metavar="N",
                     help=f"With --calibrate: a routed expert that saw fewer tokens keeps the data-free rule "
                          f"[default: {DEFAULT_MIN_EXPERT_TOKENS}]; the run says how many did."),
    ]):
        f = deco(f)
    return f


def _calib_config(calibrate, calibration, calib_tokens, act_order, damp, device, min_expert_tokens):
    """A CalibConfig for --calibrate (None without it; calibration options without it are refused)."""
    from .calibrate import CalibConfig

    given = [n for n, v in (("--calibration-data", calibration), ("--tokens", calib_tokens),
                            ("--act-order/--no-act-order", act_order), ("--damp", damp),
                            ("--min-expert-tokens", min_expert_tokens)) if v is not None]
    if device != "cpu":
        given.append("--device")
    if not calibrate:
        if given:
            raise KimiQuantError(f"{given[0]} applies only with --calibrate")
        return None
    if device != "cpu":
        import torch

        available = {"cuda": torch.cuda.is_available(),
                     "npu": bool(getattr(torch, "npu", None) and torch.npu.is_available())}
        if not available[device]:
            raise KimiQuantError(f"--device {device}: torch sees no {device} device here; use --device cpu")
    base = CalibConfig()
    return CalibConfig(calibration=calibration or base.calibration, tokens=calib_tokens or base.tokens,
                       act_order=act_order, damp=damp, device=device,
                       min_expert_tokens=min_expert_tokens or base.min_expert_tokens)


# -- plan ---------------------------------------------------------------------------------------
def _local_source(source: str) -> bool:
    return Path(source).expanduser().exists()


def _staging_options_for(source: str, revision, work_dir, max_disk, keep_source=False, link_gbps=None) -> None:
    """A local directory has no revisions and is read in place: --revision is refused (the run would
    not be the revision asked for), the staging options are ignored with a warning."""
    if not _local_source(source):
        return
    if revision:
        raise KimiQuantError(f"--revision {revision}: {source} is a local directory, which has no revisions "
                             "(give the hub repo id to convert a revision, or drop --revision)")
    ignored = [name for name, v in (("--work-dir", work_dir), ("--max-disk", max_disk),
                                    ("--keep-source", keep_source), ("--link-gbps", link_gbps)) if v]
    if ignored:
        click.echo(f"kimi-quant: warning: {', '.join(ignored)} ignored: {source} is a local directory, read in "
                   "place (these options are about downloading and staging hub sources)", err=True)


@main.command(short_help="Size the job from headers only: output, disk, memory, time, schemes.")
@_plan_options
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Workers the memory and time estimates assume (default: one per core; with --executor ray, "
                   "the workers of your cluster).")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Executor the estimates assume (Ray: each worker as fast as one core of this machine).")
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
@_calibrate_options
def plan(source, target, recipe, overrides, max_shard_size, revision, group_size, workers, executor, work_dir, max_disk,
         link_gbps, json_path, show_shards, verbose, remeasure, quiet=False, calibrate=False, calibration=None,
         calib_tokens=None, act_order=None, damp=None, device="cpu", min_expert_tokens=None):
    """Size a conversion before running it, from headers only (no tensor data is read): output size,
    disk needed, peak memory and wall time for the given --workers/--executor, model_quant_type, and
    (-v) the scheme of every tensor group and the output shards.

    The time comes from this machine's codec rates, measured once (about a second) and stored in
    the kimi-quant cache (KIMI_QUANT_CACHE); --remeasure takes them again.

    With --calibrate (and --tokens), also the time and memory a calibrated conversion needs,
    from GPTQ and matmul speeds measured here (a few seconds) and the model's shapes.
    """
    from .convert import build_plan
    from .estimate import load_rates, size_job

    if quiet and (verbose or show_shards):
        raise KimiQuantError(f"--quiet prints nothing: drop it or {'--verbose' if verbose else '--shards'}")
    if calibrate:
        require_torch("plan --calibrate (it measures this machine's GPTQ and forward rates)")
    cal = _calib_config(calibrate, calibration, calib_tokens, act_order, damp, device, min_expert_tokens)
    _staging_options_for(source, revision, work_dir, max_disk, link_gbps=link_gbps)
    hub = not _local_source(source)
    src = _open(source, revision, work_dir if hub else None)
    try:
        p = build_plan(src, target, recipe, overrides, max_shard_size, group_size, calibrated=cal is not None)
        if cal is not None:
            from .model.spec import load_model_spec_from_source

            spec = load_model_spec_from_source(src, recipe_given=True)
            if spec.text is None:
                raise KimiQuantError("--calibrate runs the Kimi K3-family forward; this model is not one")
    finally:
        src.close()
    workers = workers or os.cpu_count() or 1
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
        from .calibrate.estimate import estimate

        cal_est = estimate(p, spec, cal, workers)
        cal_lines = _calibrate_lines(cal_est, cal, workers)
    if json_path:  # first: an unwritable path fails before any of the plan is printed
        from .write import write_atomic

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
    for line in [*plan_summary(p, job, work_dir=src.work_dir), *cal_lines]:
        click.echo(line)
    if verbose or show_shards:
        click.echo(f"\n{'scheme':14s} {'tensors':>8s} {'in':>12s} {'out':>12s}")
        for s in sorted(counts):
            click.echo(f"{s:14s} {counts[s]:8d} {_gb(in_by[s]):>12s} {_gb(out_by[s]):>12s}")
        click.echo(f"{'total':14s} {sum(counts.values()):8d} {_gb(p.in_bytes):>12s} {_gb(p.out_bytes):>12s}")
        click.echo("")
        for u in p.units:
            needs = ", ".join(u.needs[:3]) + (f" (+{len(u.needs) - 3})" if len(u.needs) > 3 else "")
            click.echo(f"  {u.file}  {len(u.tensors):6d} tensors  {_gb(u.out_bytes):>10s}  <- {needs}")
    else:
        click.echo("(-v: tensors per scheme and the output shard list)")
    if json_path:
        click.echo(f"plan written to {json_path}")


def _calibrate_lines(e: dict, cal, workers: int) -> list[str]:
    """plan --calibrate: the calibrated conversion's time and memory (calibrate/estimate.py)."""
    def dur(h: float) -> str:
        return fmt_duration(h * 3600)

    return [f"calibrate ~{dur(e['hours'])} on {workers} cores ({dur(e['core_hours'])} of one core: forward "
            f"{dur(e['forward_core_h'])}, Hessians {dur(e['hessian_core_h'])}, GPTQ {dur(e['gptq_core_h'])}; "
            f"{cal.tokens} tokens; measured here: fp32 {e['fp32_gflops']:.0f} / fp64 {e['fp64_gflops']:.0f} "
            "GFLOP/s per core; GPTQ per routed-expert matrix "
            + ", ".join(f"{k} {v:.1f} s" for k, v in e["gptq_s_per_expert_matrix"].items()) + ")",
            f"         memory ~{_gb(e['memory_bytes'])} peak (one layer's non-expert weights + experts in use + "
            f"activations of {cal.tokens} tokens + Hessians of {cal.expert_batch} experts + one GPTQ); "
            "shards are cut at layer boundaries"]


def packed_source_line(p) -> str | None:
    """What becomes of a source's packed MXFP4 tensors (None for a BF16 source)."""
    from .plan import packed_words

    summary = p.packed_summary
    return f"source   {packed_words(summary)}" if summary else None


def plan_summary(p, job: dict, work_dir=None) -> list[str]:
    """The sizing lines ``plan`` prints first: what is converted, output, disk, memory, time, model_quant_type."""
    from .plan import PER_GROUP_LOADERS, model_quant_type_meaning

    lines = [f"plan     {p.source}" + (f" @ {p.revision}" if p.revision else "")
             + f" -> {p.target} (recipe {p.recipe['name']}"
             + (f", int4 per group of {p.int4_group_size}" if p.int4_group_size else "")
             + f"): {_count(job['units'], 'output shard')} (max {_gb(p.max_shard_size)})",
             f"output   {_gb(job['out_bytes'])} ({job['out_bytes'] / max(job['in_bytes'], 1):.1%} of "
             f"{_gb(job['in_bytes'])} {'MXFP4 + BF16' if p.packed_summary else 'BF16'} input)"]
    if p.packed_summary:
        lines.append(packed_source_line(p))
    if job["disk_staging_bytes"] is None:
        lines.append(f"disk     {_gb(job['disk_needed_bytes'])}: the output (a local source is read in place)")
    else:
        free = ""
        if work_dir is not None:
            import shutil

            probe = Path(work_dir)
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            try:
                free = f"; {_gb(shutil.disk_usage(probe).free)} free at {probe}"
            except OSError:
                pass
        lines.append(f"disk     {_gb(job['disk_needed_bytes'])}: the output + a staging window of "
                     f"{_gb(job['disk_staging_bytes'])} in --work-dir {work_dir}{free}")
        window = (f"--max-disk is below the {_gb(job['min_max_disk_bytes'])} one output shard needs at once: "
                  "convert would refuse it" if job["max_disk_too_small"] else
                  f"--max-disk at least {_gb(job['min_max_disk_bytes'])} (the source shards of the largest "
                  "output shard)")
        lines.append(f"         {window}")
    if job["executor"] == "local":
        lines.append(f"memory   ~{_gb(job['memory_peak_bytes'])} peak: the driver + {job['workers']} workers x "
                     f"{_gb(job['memory_per_worker_bytes'])} (largest quantized tensor in + out, buffers)")
    else:
        lines.append(f"memory   ~{_gb(job['memory_peak_bytes'])} for the driver; each Ray worker "
                     f"~{_gb(job['memory_per_worker_bytes'])} on top of Ray's own")
    if "wall_seconds" in job:
        who = (_count(job['parallel'], 'local worker') if job["executor"] == "local"
               else f"{job['parallel']} Ray workers, each as fast as one core here")
        lines.append(f"time     ~{fmt_duration(job['wall_seconds'])} on {who} ({fmt_duration(job['core_seconds'])} of "
                     f"one core at this machine's codec rates, ~{job['rate_gbps']:.2f} GB/s)")
        if job.get("compile_seconds"):
            lines.append(f"         + ~{fmt_duration(job['compile_seconds'])} compiling the kernels (first run only)")
        if job.get("calibrate_seconds"):
            lines.append(f"         incl. ~{fmt_duration(job['calibrate_seconds'])} for --calibrate")
        if job["download_bytes"] and job.get("link_gbps"):
            limit = "the link is the limit" if job["limit"] == "download" else "converting is the limit"
            lines.append(f"         downloading {_gb(job['download_bytes'])} at {job['link_gbps']:g} GB/s overlaps "
                         f"with converting: {limit}")
        elif job["download_bytes"]:
            lines.append(f"         + downloading {_gb(job['download_bytes'])}, overlapped with converting "
                         f"(alone at 1 GB/s: {fmt_duration(job['download_bytes'] / 1e9)}; --link-gbps counts it)")
    kernels = job.get("kernels") or {}
    if kernels.get("build") == "jit" and job["executor"] == "local":
        lines.append(f"kernels  numba's JIT (same bytes, ~0.7 s more start-up per run): the compiled kernels are "
                     f"not used ({kernels['why']}); delete {kernels['retry']} to build them again")
    lines.append("quant    " + model_quant_type_meaning(p.description()["model_quant_type"], set(p.scheme_counts())))
    if p.int4_group_size:
        lines.append(f"loaders  {PER_GROUP_LOADERS}: --group-size 0 writes what all of them load")
    return lines


# -- convert ------------------------------------------------------------------------------------
@main.command(short_help="Convert a BF16 checkpoint (dir or hub repo) for a device.")
@_plan_options(output=True)
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
@_calibrate_options
def convert(source, target, recipe, overrides, max_shard_size, revision, group_size, output, workers, executor,
            ray_address, overwrite, work_dir, max_disk, keep_source, do_validate, max_ppl_increase, push_to, hash_inputs,
            quiet, hub_revision=None, calibrate=False, calibration=None, calib_tokens=None, act_order=None, damp=None,
            device="cpu", min_expert_tokens=None):
    """Convert SOURCE (a local directory or a hub repo id) for a device family.

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
        from .targets import resolve_target

        resolve_target(target)
        _staging_options_for(source, revision, work_dir, max_disk, keep_source)
        if calibrate or do_validate:
            require_torch("--calibrate" if calibrate else "--validate")
        if max_ppl_increase is not None and not do_validate:
            raise KimiQuantError("--max-ppl-increase applies only with --validate")
        if hub_revision is not None and not push_to:
            raise KimiQuantError("--hub-revision applies only with --push-to-hub")
        if do_validate and not Path(source).expanduser().is_dir():
            raise KimiQuantError("--validate needs the BF16 source as a local directory (hub shards are deleted as "
                                 "they are converted); run `kimi-quant validate BF16_DIR OUTPUT` where both exist")
        if not calibrate and not do_validate:
            # numpy's OpenBLAS starts a thread per core that spins for a while once numpy loads (~0.1 core-s a
            # run, taken from the workers); nothing in a plain conversion multiplies matrices (workers: the same)
            os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        if executor == "local" and not calibrate and (workers or default_workers()) > 1 \
                and (do_validate or not fork_workers_here()):
            # workers that cannot be forked from this process (see executor.fork_server; --validate imports
            # torch) come from a fork server: its start-up (python, numpy, the unit code, the kernels) runs
            # while this process imports numpy and plans, and convert's executor finds the server running.
            # A Ctrl-C meanwhile most likely lands in an import: see _forget_caught_interrupt
            start_fork_server()
        from .convert import ConvertOptions, convert as run_convert

        gc.freeze()  # this process's modules live to its end: its full collections need not walk them
    if do_validate:  # a model validation cannot run is refused before the conversion, not after it
        from .model.spec import load_model_spec
        from .runtime.forward import check_supported

        check_supported(load_model_spec(Path(source).expanduser()).text)
    source_options = {}
    if work_dir or max_disk or keep_source:
        source_options = {"work_dir": work_dir, "max_disk": max_disk, "keep_source": keep_source}
    opts = ConvertOptions(target=target, output=Path(output), recipe=recipe, overrides=list(overrides),
                          max_shard_size=max_shard_size, workers=workers, executor=executor,
                          executor_options={"address": ray_address} if ray_address else {},
                          overwrite=overwrite, quiet=quiet, revision=revision, source_options=source_options,
                          hash_inputs=hash_inputs, group_size=group_size,
                          calibrate=_calib_config(calibrate, calibration, calib_tokens, act_order, damp, device,
                                                  min_expert_tokens))
    res = run_convert(source, opts)
    p = res.plan
    if not quiet:
        counts = ", ".join(f"{s} {n}" for s, n in sorted(p.scheme_counts().items()))
        if res.converted_units:
            startup = (f" ({res.startup_seconds:.1f} s of it loading the kernels"
                       + (", compiled on this first run" if res.startup_seconds > 5 else "") + ")"
                       if res.startup_seconds and res.startup_seconds >= 1 else "")
            click.echo(f"done in {res.seconds:.1f} s{startup}: {_count(res.converted_units, 'shard')} written"
                       + (f", {res.reused_units} verified and kept" if res.reused_units else "")
                       + f"; {_gb(res.in_bytes_done)} in at {_rate(res.in_bytes_done, res.work_seconds)}")
        else:
            click.echo(f"done in {res.seconds:.1f} s: nothing to convert, {_count(res.reused_units, 'shard')} "
                       "verified and kept")
        click.echo(f"input {_gb(p.in_bytes)} -> output {_gb(p.out_bytes)} in {_count(len(p.units), 'shard')}; "
                   f"tensors: {counts}")
        if p.packed_summary:
            click.echo(packed_source_line(p).removeprefix("source   "))
        if res.calibration is not None:
            from .layout.model_card import describe_calibration

            click.echo(f"calibration: {describe_calibration(res.calibration)}")
        if res.peak_staged_bytes is not None:
            click.echo(f"peak staging disk {_gb(res.peak_staged_bytes)}")
        click.echo(f"output: {res.out_dir}")
    if do_validate:
        _validate_after(source, res.out_dir, max_ppl_increase, quiet)
    if push_to:
        from .publish import publish as run_publish

        run_publish(res.out_dir, push_to, branch=hub_revision, echo=lambda m: click.echo(m, err=True))


def _validate_after(source, out_dir, max_ppl_increase, quiet):
    from .lock import output_lock
    from .layout.validation import record
    from .validate.run import format_table, run_validation

    lock = output_lock(out_dir).acquire()  # it writes into the output: no convert there meanwhile
    try:
        report = run_validation(source, out_dir, progress=False)
        if not quiet:
            click.echo(format_table(report))
        record(out_dir, report, max_ppl_increase, source=source if Path(source).expanduser().is_dir() else None)
    finally:
        lock.release()


# -- verify ------------------------------------------------------------------------------------
@main.command(short_help="Check an output: hashes, index, description, shapes, validation.")
@click.argument("output", type=click.Path(file_okay=False))
@click.option("--no-rehash", is_flag=True, help="Skip re-hashing shards (sizes and headers are still checked).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Also write the result as JSON here (shards, tensors, bytes, model_quant_type, validation).")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing: the exit code says it (0 ok, 2 damaged, 3 failed "
                                                   "validation).")
def verify(output, no_rehash, json_path=None, quiet=False):
    """Check an output directory: shards against the journal, index, description, shapes.

    Exit code 2 when the output is damaged or incomplete, 3 when it is intact but its recorded
    validation failed (perplexity above --max-ppl-increase)."""
    from .verify import verify_output

    from .layout.validation import failed_validation

    def write_result(result: dict) -> None:
        from .write import write_atomic

        try:
            write_atomic(json_path, json.dumps(result, indent=1, default=str).encode())
        except OSError as e:
            raise KimiQuantError(f"{json_path}: cannot write the result ({e.strerror or e})") from None

    try:
        r = verify_output(output, rehash=not no_rehash, quiet=quiet)
    except KimiQuantError as e:
        if json_path:  # the file says it too: "ok" false, the one line, the exit code
            write_result({"ok": False, "error": str(e), "exit_code": e.exit_code})
        raise
    v = r.get("validation")
    failed = failed_validation(v)
    if json_path:
        write_result({"ok": not failed, "error": f"{failed} (publish refuses it unless --force)" if failed else None,
                      "exit_code": ValidationFailed.exit_code if failed else 0, **r})
    if not quiet:
        click.echo(f"ok: {_count(r['shards'], 'shard')}, {r['tensors']} tensors, {_gb(r['bytes'])}, "
                   f"model_quant_type {r['model_quant_type']}")
        click.echo(f"    {r['model_quant_type_meaning']}")
    if failed:
        raise ValidationFailed(f"{output}: {failed} (publish refuses it unless --force)")
    if quiet:
        return
    if isinstance(v, dict) and all(isinstance(v.get(k), (int, float)) for k in ("ratio", "ppl_bf16", "ppl_quant")):
        bound = f", bound {v['max_ppl_increase_pct']}%" if v.get("max_ppl_increase_pct") is not None else ", no bound"
        click.echo(f"validated: perplexity {(v['ratio'] - 1) * 100:+.2f}% vs BF16 ({v['ppl_bf16']:.4f} -> "
                   f"{v['ppl_quant']:.4f}{bound})")
    elif r.get("validation_void"):
        click.echo(f"not validated: the recorded validation is void ({r['validation_void']}); kimi-quant validate "
                   "BF16_DIR OUTPUT measures this output")
    elif not v:
        click.echo("not validated (kimi-quant validate BF16_DIR OUTPUT measures perplexity)")


# -- synth -------------------------------------------------------------------------------------
@main.command(short_help="Write a K3.1-shaped BF16 checkpoint (tiny, bench, full).")
@click.option("--preset", type=click.Choice(["tiny", "bench", "full"]), default="tiny", show_default=True,
              help="tiny: the trained 1.7M-parameter K3.1-shaped model; bench: GB-sized, real expert shapes; "
                   "full: the real 2.8T K3.1 Pro inventory, headers only (implies --sparse).")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False),
              help="Directory to write (created; must be empty unless --overwrite).")
@click.option("--overwrite", is_flag=True,
              help="Write into a non-empty directory, first deleting an earlier checkpoint's model-*.safetensors, "
                   "index and config.json there (other files are kept).")
@click.option("--num-experts", type=click.IntRange(min=1),
              help="Routed experts per MoE layer, instead of the preset's (scales the checkpoint size; "
                   "tiny then gets random weights).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--random-weights", is_flag=True, help="tiny: seeded random weights instead of the trained fixture.")
@click.option("--shard-size", type=Size(), default="512MiB", show_default=True,
              help=f"bench/full: source shard size ({SIZE_UNITS}).")
@click.option("--sparse", is_flag=True, help="Headers only, data left as holes: for `plan` without the bytes.")
@click.option("--experts", type=click.Choice(["bf16", "mxfp4"]), default="bf16", show_default=True,
              help="mxfp4: routed experts as Moonshot publishes Kimi K3 (compressed-tensors mxfp4-pack-quantized: "
                   "E2M1 codes and E8M0 scales), the rest BF16.")
def synth(preset, output, overwrite, num_experts, seed, random_weights, shard_size, sparse, experts):
    """Write a K3.1-shaped checkpoint with the real tensor names (for tests, demos, benchmarks): BF16,
    or with --experts mxfp4 in the layout Kimi K3 is published in.

    \b
      kimi-quant synth --preset tiny -o tiny-bf16
      kimi-quant synth --preset tiny --experts mxfp4 -o tiny-released
      kimi-quant synth --preset full --experts mxfp4 --shard-size 16GiB -o k3-released   # headers only"""
    from .synth import synth as run_synth

    out = run_synth(preset, output, seed=seed, num_experts=num_experts, shard_size=shard_size,
                    random_weights=random_weights, progress=True, sparse=sparse, overwrite=overwrite,
                    experts=experts)
    click.echo(f"wrote {out}")


# -- demo ------------------------------------------------------------------------------------------
@main.command(short_help="The whole job on the bundled tiny model, end to end.")
@click.option("--output", "-o", default="kimi-quant-demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--validate/--no-validate", "do_validate", default=True, show_default=True,
              help="Measure perplexity of each output against the BF16 model.")
@click.pass_context
def demo(ctx, output, do_validate):
    """Run the whole job on the bundled tiny K3.1-shaped model: synth -> convert (a3, 950dt) -> verify -> validate."""
    from .synth import synth as run_synth

    out = Path(output)
    if do_validate:
        try:
            require_torch("validation")
        except KimiQuantError as e:
            click.echo(f"note: the outputs are converted and verified, not validated: {e}")
            do_validate = False
    src = out / "tiny-bf16"
    if not (src / "config.json").exists():  # config.json is written last: without it, an interrupted synth
        run_synth("tiny", src, overwrite=True)
    click.echo(f"source: {src} (bundled tiny K3.1-shaped model)")
    for target in ("a3", "950dt"):
        _demo_convert(ctx, src, out / f"tiny-{target}", target, do_validate)
    released = out / "tiny-released"
    if not (released / "config.json").exists():
        run_synth("tiny", released, overwrite=True, experts="mxfp4")
    click.echo(f"\nsource: {released} (the same model as Kimi K3 is published: MXFP4 routed experts)")
    _demo_convert(ctx, released, out / "tiny-released-950dt", "950dt", do_validate)
    click.echo(f"\nthe demo's checkpoints are in {out}: {src.name} and {released.name} (the sources), tiny-a3, "
               "tiny-950dt and tiny-released-950dt, each with its model card (README.md)")
    click.echo("next: kimi-quant plan SOURCE --target 950dt sizes a conversion of your own checkpoint (a local "
               "directory or a hub repo id)")


def _demo_convert(ctx, src: Path, dest: Path, target: str, do_validate: bool) -> None:
    click.echo(f"\n== convert --target {target} -> {dest}")
    ctx.invoke(convert, source=str(src), target=target, recipe=None, overrides=(), max_shard_size=parse_size("1MB"),
               revision=None, group_size=None, output=str(dest), workers=None, executor="local", ray_address=None,
               overwrite=False, work_dir=None, max_disk=None, keep_source=False, do_validate=do_validate,
               max_ppl_increase=None, push_to=None, hash_inputs=False, quiet=False)
    ctx.invoke(verify, output=str(dest), no_rehash=False, json_path=None, quiet=False)


def _register_optional_commands() -> None:
    """Commands whose modules live with their feature (validation, publishing)."""
    for module, name in (("kimi_quant.validate.command", "validate"), ("kimi_quant.publish.command", "publish")):
        try:
            mod = __import__(module, fromlist=[name])
        except ImportError:
            continue
        main.add_command(getattr(mod, name), name)


_register_optional_commands()


def run() -> None:
    """The program (``kimi-quant``, ``python -m kimi_quant.cli``): the CLI, then Ctrl-C ignored while the
    interpreter tears down. The exit status is chosen by then; a Ctrl-C landing in the teardown (the
    process pool's exit handler joins its threads) would kill a finished run by SIGINT, saying nothing."""
    try:
        main()
    except BrokenPipeError:  # click's own output (--help, usage) into a closed pipe
        _quiet_broken_pipe()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    run()
