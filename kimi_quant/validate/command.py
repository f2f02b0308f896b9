"""``kimi-quant validate SOURCE QUANTIZED``: perplexity and per-layer agreement (registered by the cli package)."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import KimiQuantError, ValidationFailed
from ..options import old_name, takes_old_name


class _OneLineError(click.ClickException):
    """A KimiQuantError as click sees it: under ``kimi-quant`` the group prints it like any other command's
    error (one line, exit 2, the original traceback with --debug); run on its own (click.testing, an
    embedding app) click's ``show`` prints the same line."""

    exit_code = 2

    def show(self, file=None):
        click.echo(f"kimi-quant: error: {self.format_message()}", err=True)


def _check_source(source: Path, quantized: Path) -> str | None:
    """Refuse a SOURCE whose shards differ from those the output's provenance records (size, and the
    sha256 where both sides know it; nothing is hashed here): another checkpoint gives a meaningless ratio."""

    from ..layout.ascend_v1 import PROVENANCE
    from ..layout.records import read_provenance
    from ..source.local import LocalSource

    inputs = read_provenance(quantized).get("inputs")
    if not isinstance(inputs, dict):
        return None  # nothing to compare with
    here = {f.name: f for f in LocalSource(source).files()}
    for name, rec in sorted(inputs.items()):
        f = here.get(name)
        if f is None:
            why = "is missing"
        elif f.size != rec.get("size"):
            why = f"has {f.size} bytes, the output was made from {rec.get('size')}"
        elif rec.get("sha256") and f.sha256 and f.sha256 != rec["sha256"]:
            why = "has another sha256 than the output was made from"
        else:
            continue
        return (f"{source}/{name} {why} ({quantized}/{PROVENANCE}): validate against the checkpoint the output "
                "was converted from")
    return None


@click.command("validate", short_help="Perplexity and per-layer error of QUANTIZED vs BF16.")
@click.argument("source", type=click.Path(exists=True, file_okay=False))
@click.argument("quantized", type=click.Path(exists=True, file_okay=False))
@click.option("--eval-data", "calibration", default=None, metavar="FILE|NAME", callback=takes_old_name,
              help="Text perplexity is measured on: jsonl ('text' field), txt or parquet file, builtin:heldout "
                   "(default) / builtin:train, or a hub dataset id (online only).")
@old_name("--calibration", "calibration", "--eval-data")
@click.option("--tokens", "max_tokens", type=click.IntRange(min=1), default=4096, show_default=True, metavar="N",
              callback=takes_old_name, help="Tokens of the --eval-data text to score.")
@old_name("--max-tokens", "max_tokens", "--tokens", type=click.IntRange(min=1))
@click.option("--seq-len", type=int, default=512, show_default=True, help="Window length (non-overlapping).")
@click.option("--max-ppl-increase", type=float, default=None, metavar="PCT",
              help="Fail (exit code 3) if quantized perplexity exceeds BF16 by more than PCT percent; the "
                   "output is then marked as failing (verify fails, publish refuses it unless --force).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Also write the full report as JSON here (a kimi-quant output always gets its own copy, "
                   "kimi_quant_validation.json).")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
@click.option("--force", is_flag=True,
              help="Run even when SOURCE is not the checkpoint QUANTIZED was converted from (its shards differ from "
                   "the recorded ones, or the first layer disagrees): the numbers are shown, never recorded.")
@click.option("--eager-experts", is_flag=True, hidden=True,
              help="Load every routed expert of a layer up front (reference path; needs ~all experts in fp32).")
def validate(source, quantized, calibration, max_tokens, seq_len, max_ppl_increase, json_path, quiet, force,
             eager_experts):
    """Compare QUANTIZED (an ascendV1 output dir) with its BF16 SOURCE: perplexity on the same windows
    and per-layer cosine / relative error, with the device's activation quantization simulated.

    \b
    cosine     mean over tokens of the cosine similarity between the BF16 and the quantized
               model's hidden state after that layer (1 = same direction)
    cos_min    the lowest of those per-token cosines: one badly hit token shows here
    rel_error  ||x_quant - x_bf16|| / ||x_bf16|| over all tokens

    A kimi-quant output is verified first (as `kimi-quant verify`): a damaged shard fails, with no
    ratio. The report, the verdict against --max-ppl-increase and the model card's numbers are
    written into a kimi-quant output, exactly as `convert --validate` does."""
    from ..errors import require_torch

    require_torch("validate")
    from ..journal import JOURNAL
    from ..lock import output_lock
    from ..verify import verify_output
    from .run import run_validation

    ours = (Path(quantized) / JOURNAL).exists()
    # a kimi-quant output: it reads the shards and writes the report and card, so no conversion in there meanwhile
    lock = output_lock(quantized) if ours else None
    try:
        try:
            if lock is not None:
                lock.acquire()
            # Validation reads the output's tensors, not its hashes: a damaged shard would still give a ratio.
            # Only kimi-quant outputs have a journal to check against; another tool's ascendV1 dir is taken as is.
            mismatch = None
            if ours:
                verify_output(quantized, rehash=True, quiet=quiet)
                mismatch = _check_source(Path(source), Path(quantized))
                if mismatch and not force:
                    raise KimiQuantError(f"{mismatch} (--force shows the numbers without recording them)")
            report = run_validation(source, quantized, calibration=calibration, max_tokens=max_tokens,
                                    seq_len=seq_len, json_path=json_path, progress=not quiet,
                                    lazy_experts=not eager_experts)
        except KimiQuantError as e:
            raise _OneLineError(str(e)) from e
        try:
            _report(source, quantized, report, max_ppl_increase, json_path, ours, force, mismatch)
        except ValidationFailed:
            raise
        except KimiQuantError as e:
            raise _OneLineError(str(e)) from e
    finally:
        if lock is not None:
            lock.release()


def _report(source, quantized, report, max_ppl_increase, json_path, ours, force=False, mismatch=None):
    from ..layout.ascend_v1 import VALIDATION
    from ..layout.validation import not_its_source, record
    from .run import format_table

    wrong = not_its_source(report)
    if ours and wrong and not force:  # before any number is shown: none of them is about this output
        raise KimiQuantError(f"{wrong}; nothing recorded in {quantized} (--force shows the numbers without recording "
                             "them)")
    click.echo(format_table(report))
    if not 0.8 <= report["ratio"] <= 2.0:
        click.echo(f"kimi-quant: warning: a perplexity ratio of {report['ratio']:.4f} is implausible for a faithful "
                   f"quantization: is {source} the checkpoint {quantized} was converted from?", err=True)
    failed = None
    try:
        # the report, the verdict and the card, into the output (bound to both directories' identities)
        verdict = record(quantized, report, max_ppl_increase, source=source, force=force, mismatch=mismatch)
    except ValidationFailed as e:
        failed, verdict = e, {}
    if ours and verdict.get("recorded", True):
        click.echo(f"report written to {Path(quantized) / VALIDATION}")
    if json_path:
        click.echo(f"report written to {json_path}")
    if failed is not None:
        raise failed  # exit code 3
