"""``verify``, ``synth`` and ``demo``: checking an output, writing checkpoints, the whole job on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import KimiQuantError, ValidationFailed, require_torch
from ..progress import fmt_size
from .app import main
from .convert_cmd import convert
from .params import SIZE_UNITS, Size, count_noun, parse_size


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
    from ..verify import verify_output

    from ..layout.validation import failed_validation

    def write_result(result: dict) -> None:
        from ..write import write_atomic

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
        click.echo(f"ok: {count_noun(r['shards'], 'shard')}, {r['tensors']} tensors, {fmt_size(r['bytes'])}, "
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
    from ..synth import synth as run_synth

    out = run_synth(preset, output, seed=seed, num_experts=num_experts, shard_size=shard_size,
                    random_weights=random_weights, progress=True, sparse=sparse, overwrite=overwrite,
                    experts=experts)
    click.echo(f"wrote {out}")



@main.command(short_help="The whole job on the bundled tiny model, end to end.")
@click.option("--output", "-o", default="kimi-quant-demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--validate/--no-validate", "do_validate", default=True, show_default=True,
              help="Measure perplexity of each output against the BF16 model.")
@click.pass_context
def demo(ctx, output, do_validate):
    """Run the whole job on the bundled tiny K3.1-shaped model: synth -> convert (a3, 950dt) -> verify -> validate."""
    from ..synth import synth as run_synth

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

