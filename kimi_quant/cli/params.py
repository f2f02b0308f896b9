"""What the commands share: size arguments, the options that shape a plan, the calibration options."""

from __future__ import annotations

import re
from pathlib import Path

import click

from ..errors import KimiQuantError
from ..options import old_name, takes_old_name
from ..progress import SIZE_SUFFIXES


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


def count_noun(n: int, noun: str) -> str:
    """``1 shard``, ``2 shards``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def fmt_rate(n: int, seconds: float) -> str:
    """Bytes per second in GB/s, or MB/s / kB/s where GB/s would read 0.00."""
    r = n / max(seconds, 1e-9)
    return f"{r / 1e9:.2f} GB/s" if r >= 1e8 else f"{r / 1e6:.2f} MB/s" if r >= 1e5 else f"{r / 1e3:.1f} kB/s"


def plan_shape_options(f=None, *, output: bool = False):
    """SOURCE, -t and the options that shape the plan; ``output=True`` puts -o right after -t (convert)."""
    if f is None:
        return lambda g: plan_shape_options(g, output=output)
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


def open_named_source(source, revision, work_dir=None):
    from ..source import open_source

    return open_source(source, revision=revision, work_dir=work_dir)


def calibration_options(f):
    from ..calibrate.config import (DEFAULT_MIN_EXPERT_TOKENS, DEFAULT_TEXT, DEFAULT_TOKENS, EXPERT_TOKENS,
                                    GPTQ_DEFAULTS, MAX_EXPERT_BATCH, MIN_EXPERT_BATCH)

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
                     help="With --calibrate: where GPTQ, the forward and the Hessians run (cuda / npu where "
                          "torch has them; plan sizes a run there without needing one)."),
        click.option("--min-expert-tokens", type=click.IntRange(min=1), default=None, metavar="N",
                     help=f"With --calibrate: a routed expert that saw fewer tokens keeps the data-free rule, "
                          f"or, if its weights are MXFP4 values made int4, gets GPTQ from every token "
                          f"[default: {DEFAULT_MIN_EXPERT_TOKENS}]; the run says how many did."),
        click.option("--expert-tokens", type=click.Choice(EXPERT_TOKENS), default=None,
                     help="With --calibrate: the tokens a routed expert's Hessian sees: those routed to it, or all "
                          "of the layer's input tokens (the layer's output still follows the router) "
                          "[default: routed]."),
        click.option("--expert-batch", type=click.IntRange(min=1), default=None, metavar="N",
                     help=f"With --calibrate: routed experts handed to the workers at once; the driver holds their "
                          f"weights and results meanwhile. Same bytes for any N [default: one per worker, "
                          f"{MIN_EXPERT_BATCH} to {MAX_EXPERT_BATCH}]."),
    ]):
        f = deco(f)
    return f


def calib_config(calibrate, calibration, calib_tokens, act_order, damp, device, min_expert_tokens,
                 expert_tokens=None, expert_batch=None, need_device: bool = True):
    """A CalibConfig for --calibrate (None without it; calibration options without it are refused).
    ``need_device``: --device must be one torch sees here (convert runs on it; plan only describes a run)."""
    from ..calibrate import CalibConfig

    given = [n for n, v in (("--calibration-data", calibration), ("--tokens", calib_tokens),
                            ("--act-order/--no-act-order", act_order), ("--damp", damp),
                            ("--min-expert-tokens", min_expert_tokens), ("--expert-tokens", expert_tokens),
                            ("--expert-batch", expert_batch))
             if v is not None]
    if device != "cpu":
        given.append("--device")
    if not calibrate:
        if given:
            raise KimiQuantError(f"{given[0]} applies only with --calibrate")
        return None
    if device != "cpu" and need_device:
        import torch

        available = {"cuda": torch.cuda.is_available(),
                     "npu": bool(getattr(torch, "npu", None) and torch.npu.is_available())}
        if not available[device]:
            raise KimiQuantError(f"--device {device}: torch sees no {device} device here; use --device cpu")
    base = CalibConfig()
    return CalibConfig(calibration=calibration or base.calibration, tokens=calib_tokens or base.tokens,
                       act_order=act_order, damp=damp, device=device,
                       min_expert_tokens=min_expert_tokens or base.min_expert_tokens,
                       expert_tokens=expert_tokens or base.expert_tokens, expert_batch=expert_batch)


def is_local_dir(source: str) -> bool:
    return Path(source).expanduser().exists()


def check_staging_options(source: str, revision, work_dir, max_disk, keep_source=False, link_gbps=None) -> None:
    """A local directory has no revisions and is read in place: --revision is refused (the run would
    not be the revision asked for), the staging options are ignored with a warning."""
    if not is_local_dir(source):
        return
    if revision:
        raise KimiQuantError(f"--revision {revision}: {source} is a local directory, which has no revisions "
                             "(give the hub repo id to convert a revision, or drop --revision)")
    ignored = [name for name, v in (("--work-dir", work_dir), ("--max-disk", max_disk),
                                    ("--keep-source", keep_source), ("--link-gbps", link_gbps)) if v]
    if ignored:
        click.echo(f"kimi-quant: warning: {', '.join(ignored)} ignored: {source} is a local directory, read in "
                   "place (these options are about downloading and staging hub sources)", err=True)
