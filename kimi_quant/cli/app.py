"""The ``kimi-quant`` group: error handling (one line, an exit code), the exit path, ``targets``.

Every user-caused failure is one line on stderr and a non-zero exit; ``--debug`` (or
KIMI_QUANT_DEBUG=1) shows the traceback as well.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback

import click

from .. import __version__
from ..errors import KimiQuantError


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
    """Convert Kimi K3 / K3.1 checkpoints (BF16, or MXFP4 experts as Moonshot publishes them) into Ascend
    ascendV1 quantized checkpoints.

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
    from ..targets import TARGETS

    for t in TARGETS.values():
        status = "supported" if t.supported else "not yet supported"
        click.echo(f"{t.name:7s} {status:18s} {t.hardware}")
        if t.supported:
            click.echo(f"{'':26s} {t.scheme}")
    click.echo("\nAliases such as A3, atlas-a3, 800i-a3, 950DT, ascend-950dt are accepted.")


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
