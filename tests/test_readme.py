"""The README stays true: every `kimi-quant` command in its code blocks parses against the real click commands
(command and every option), every --option it names exists, and the cheap commands run, in the README's order,
on the tiny model: the real model (hub id or download) stands for the tiny fixture, the full-size synth runs as
tiny (test_cli_inputs runs the full one), validate reads less text and the demo runs without its validation;
publish is parsed only (it needs a hub)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from kimi_quant.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
TINY = ROOT / "kimi_quant" / "model" / "fixtures" / "tiny"
HUB_IDS = ("moonshotai/Kimi-K3", "/models/Kimi-K3")  # the real model, from the hub or downloaded: the tiny fixture
PARSE_ONLY = {"publish"}
NOT_OURS = {"--index-url", "--local-dir", "--mxfp4-source"}  # pip's and hf download's, a bench script's


def code_block_commands(text: str) -> list[list[str]]:
    """Each `kimi-quant ...` command of the bash code blocks, as argv without the program name."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for segment in re.split(r"&&|;", line):
                words = shlex.split(segment, comments=True)
                if words[:1] == ["kimi-quant"]:
                    commands.append(words[1:])
    return commands


COMMANDS = code_block_commands(README)


def visible_option_names(cmd: click.Command) -> set[str]:
    names = set()
    for p in cmd.params:
        if isinstance(p, click.Option) and not p.hidden:
            names.update(p.opts)
            names.update(p.secondary_opts)
    return names


def test_readme_has_the_workflow_commands():
    assert [c[0] for c in COMMANDS if c] == ["demo", "targets", "plan", "convert", "verify", "validate", "publish",
                                             "synth", "plan"]


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c[:1]) for c in COMMANDS])
def test_each_readme_command_parses_with_options_that_are_shown_in_help(argv, tmp_path, monkeypatch):
    name, args = argv[0], runnable(argv)[1:]
    monkeypatch.chdir(tmp_path)
    if name == "validate":  # its two arguments must be existing directories: the output made by convert
        for d in args[:2]:
            (tmp_path / d).mkdir(parents=True, exist_ok=True)
    assert name in main.commands, f"README names `kimi-quant {name}`, which does not exist"
    cmd = main.commands[name]
    shown = visible_option_names(cmd)
    for word in args:
        if word.startswith("-"):
            assert word.split("=")[0] in shown, f"`kimi-quant {name}` has no option {word} (or it is hidden)"
    with cmd.make_context(name, list(args)):  # types, choices, required options and arguments: as the shell would
        pass


def test_every_option_the_readme_names_exists():
    """Inline mentions too (`convert --validate`, `--group-size G`): each --option is one some command shows."""
    shown = {"--debug", "--help", "--version"}
    for cmd in main.commands.values():
        shown |= visible_option_names(cmd)
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", README)) - NOT_OURS
    assert not named - shown, f"the README names options no command has: {sorted(named - shown)}"


def kq(cwd: Path, *args):
    env = {k: v for k, v in os.environ.items() if k != "KIMI_QUANT_DEBUG"}
    return subprocess.run([sys.executable, "-m", "kimi_quant.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={**env, "HF_HUB_OFFLINE": "1"}, timeout=300)


def runnable(argv: list[str]) -> list[str]:
    """The README's argv with the real model replaced by the tiny fixture and the full-size inventory by tiny."""
    out = [str(TINY) if a in HUB_IDS else a for a in argv]
    if out[0] == "synth" and "--preset" in out:
        out[out.index("--preset") + 1] = "tiny"
    if out[0] == "validate":
        out += ["--tokens", "512", "--seq-len", "128"]  # the README's command, on less text
    if out[0] == "demo":
        out += ["--no-validate"]  # validate runs next, on its own
    return out


def test_the_readme_commands_run_in_order_on_the_tiny_model(tmp_path):
    ran = []
    for argv in COMMANDS:
        if argv[0] in PARSE_ONLY:
            continue
        args = runnable(argv)
        r = kq(tmp_path, *args)
        assert r.returncode == 0, f"`kimi-quant {' '.join(args)}` failed: {r.stderr[-2000:]}"
        ran.append(argv[0])
    assert ran == ["demo", "targets", "plan", "convert", "verify", "validate", "synth", "plan"]
    assert (tmp_path / "kimi-quant-demo" / "tiny-950dt" / "README.md").is_file()
    assert (tmp_path / "K3-950dt" / "quant_model_description.json").is_file()
    assert (tmp_path / "report.json").is_file()
    assert (tmp_path / "k3-released" / "config.json").is_file()


@pytest.mark.parametrize("name", sorted(main.commands))
def test_every_command_has_help(name):
    from click.testing import CliRunner

    r = CliRunner().invoke(main, [name, "--help"])
    assert r.exit_code == 0 and f"Usage: main {name}" in r.output, r.output


def test_readme_stays_a_manual():
    assert len(README.splitlines()) <= 250
    for page in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / page).is_file(), page
