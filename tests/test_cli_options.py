"""One meaning per option name across the commands, one name per meaning, and the old spellings kept hidden
for one release (they must set what the new name sets)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from conftest import kq

from click.testing import CliRunner

from kimi_quant.cli import main

ROOT = Path(__file__).resolve().parents[1]

# option name -> (meaning, the commands that have it). A new option goes here, with a meaning no other name has.
OPTIONS = {
    "--target": ("device family", {"plan", "convert"}),
    "--recipe": ("recipe file", {"plan", "convert"}),
    "--override": ("scheme of tensors matching a glob", {"plan", "convert"}),
    "--max-shard-size": ("largest output shard", {"plan", "convert"}),
    "--revision": ("the source's hub revision", {"plan", "convert"}),
    "--group-size": ("per-group int4 size", {"plan", "convert"}),
    "--workers": ("worker processes", {"plan", "convert"}),
    "--executor": ("local processes or Ray", {"plan", "convert"}),
    "--work-dir": ("where hub shards are staged", {"plan", "convert"}),
    "--max-disk": ("most bytes of hub shards staged at once", {"plan", "convert"}),
    "--link-gbps": ("the download link's speed", {"plan"}),
    "--driver-cores": ("cores of the machine that drives a calibrated run", {"plan"}),
    "--json": ("write the command's result as JSON to FILE", {"plan", "verify", "validate"}),
    "--quiet": ("print nothing but errors", {"plan", "convert", "verify", "validate"}),
    "--shards": ("list the output shards", {"plan"}),
    "--verbose": ("more detail", {"plan"}),
    "--remeasure": ("measure the codec rates again", {"plan"}),
    "--calibrate": ("GPTQ", {"plan", "convert"}),
    "--calibration-data": ("GPTQ's text", {"plan", "convert"}),
    "--eval-data": ("the text perplexity is measured on", {"validate"}),
    "--tokens": ("how many tokens of that command's text", {"plan", "convert", "validate"}),
    "--act-order": ("GPTQ column order", {"plan", "convert"}),
    "--damp": ("GPTQ dampening", {"plan", "convert"}),
    "--device": ("where GPTQ, the forward and the Hessians run", {"plan", "convert"}),
    "--min-expert-tokens": ("tokens a routed expert needs for GPTQ", {"plan", "convert"}),
    "--expert-tokens": ("the tokens a routed expert's Hessian sees", {"plan", "convert"}),
    "--expert-batch": ("routed experts handed to the workers at once", {"plan", "convert"}),
    "--output": ("the directory written", {"convert", "synth", "demo"}),
    "--ray-address": ("Ray cluster address", {"convert"}),
    "--overwrite": ("replace an earlier kimi-quant output there", {"convert", "synth"}),
    "--keep-source": ("keep staged hub shards", {"convert"}),
    "--validate": ("measure perplexity after converting", {"convert", "demo"}),
    "--max-ppl-increase": ("perplexity bound, exit 3 past it", {"convert", "validate"}),
    "--push-to-hub": ("hub repo to upload the output to", {"convert", "publish"}),
    "--hub-revision": ("hub branch to upload to", {"convert", "publish"}),
    "--hash-inputs": ("sha256 every local source shard", {"convert"}),
    "--no-rehash": ("skip re-hashing shards", {"verify"}),
    "--preset": ("synthetic checkpoint preset", {"synth"}),
    "--num-experts": ("routed experts per layer", {"synth"}),
    "--seed": ("seed of random weights", {"synth"}),
    "--random-weights": ("random instead of trained weights", {"synth"}),
    "--shard-size": ("source shard size", {"synth"}),
    "--sparse": ("headers only", {"synth"}),
    "--experts": ("the experts' source format", {"synth"}),
    "--seq-len": ("window length", {"validate"}),
    "--private": ("create the hub repo private (--public: public)", {"publish"}),
    "--include": ("also upload files kimi-quant did not write that match a pattern", {"publish"}),
    "--force": ("go past a check's refusal (publish: a failing output; validate: a source that is not the "
                "output's, recording nothing)", {"publish", "validate"}),
    "--token": ("hub token", {"publish"}),
    "--message": ("commit message", {"publish"}),
    "--no-card": ("no model card", {"publish"}),
}

# old spelling -> (command, new spelling, a value): the old one is hidden and sets what the new one sets
OLD_NAMES = [
    ("--calibration", "convert", "--calibration-data", "builtin:heldout"),
    ("--calibration", "plan", "--calibration-data", "builtin:heldout"),
    ("--calib-tokens", "convert", "--tokens", "1234"),
    ("--calib-tokens", "plan", "--tokens", "1234"),
    ("--push-to", "convert", "--push-to-hub", "org/name"),
    ("--calibration", "validate", "--eval-data", "builtin:train"),
    ("--max-tokens", "validate", "--tokens", "777"),
    ("--repo-id", "publish", "--push-to-hub", "org/name"),
    ("--revision", "publish", "--hub-revision", "dev"),
    ("--branch", "publish", "--hub-revision", "dev"),
]

ARGS = {"plan": ["SRC", "-t", "a3"], "convert": ["SRC", "-t", "a3", "-o", "OUT"], "validate": [".", "."],
        "publish": ["OUT"]}


def _long_name(opt: click.Option) -> str:
    longs = [o for o in opt.opts if o.startswith("--")]
    return longs[0]


def visible_options() -> dict[str, set[str]]:
    """--name -> the commands that show it in --help."""
    found: dict[str, set[str]] = {}
    for name, cmd in main.commands.items():
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden and "--help" not in p.opts:
                found.setdefault(_long_name(p), set()).add(name)
    return found


def test_every_option_has_one_meaning_and_every_meaning_one_name():
    found = visible_options()
    unknown = sorted(set(found) - set(OPTIONS))
    assert not unknown, f"options missing from the table (give each a meaning no other name has): {unknown}"
    for name, commands in found.items():
        want = OPTIONS[name][1]
        assert commands == want, f"{name} is on {sorted(commands)}, the table says {sorted(want)}"
    meanings = [m for m, _ in OPTIONS.values()]
    assert len(meanings) == len(set(meanings)), "two names for one meaning"
    assert not set(OPTIONS) - set(found), f"table rows without an option: {sorted(set(OPTIONS) - set(found))}"


def test_short_options_mean_the_same_everywhere():
    shorts: dict[str, set[str]] = {}
    for cmd in main.commands.values():
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                for s in p.opts:
                    if not s.startswith("--"):
                        shorts.setdefault(s, set()).add(_long_name(p))
    assert all(len(v) == 1 for v in shorts.values()), shorts
    assert shorts["-q"] == {"--quiet"} and shorts["-o"] == {"--output"} and shorts["-t"] == {"--target"}


@pytest.mark.parametrize("old,command,new,value", OLD_NAMES)
def test_old_spelling_is_hidden_and_sets_what_the_new_one_sets(old, command, new, value):
    cmd = main.commands[command]
    olds = [p for p in cmd.params if old in p.opts]
    assert len(olds) == 1 and olds[0].hidden, f"{command} {old} must stay as a hidden option"
    base = ARGS[command]
    with cmd.make_context(command, [*base, new, value]) as ctx:
        want = dict(ctx.params)
    # the old spelling before, and after, the positional arguments: click processes given options first
    for argv in ([old, value, *base], [*base, old, value]):
        with cmd.make_context(command, list(argv)) as ctx:
            assert ctx.params == want, (argv, ctx.params, want)
    with cmd.make_context(command, list(base)) as ctx:
        assert ctx.params != want  # the value did make a difference


@pytest.mark.parametrize("extra,line", [
    (["--max-ppl-increase", "5"], "--max-ppl-increase applies only with --validate"),
    (["--hub-revision", "dev"], "--hub-revision applies only with --push-to-hub"),
    (["--tokens", "100"], "--tokens applies only with --calibrate"),
    (["--device", "cuda"], "--device applies only with --calibrate"),
])
def test_an_option_that_does_nothing_in_a_combination_is_refused(tmp_path, extra, line):
    out = tmp_path / "out"
    r = kq("convert", ROOT / "kimi_quant" / "model" / "fixtures" / "tiny", "-t", "a3", "-o", out, *extra)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"kimi-quant: error: {line}", r.stderr
    assert not out.exists()


def test_plan_quiet_with_json_writes_only_the_file_and_verify_json(tmp_path):
    tiny = ROOT / "kimi_quant" / "model" / "fixtures" / "tiny"
    r = kq("plan", tiny, "-t", "950dt", "-q", "--json", tmp_path / "plan.json")
    assert r.returncode == 0 and r.stdout == "", r.stderr
    import json

    plan = json.loads((tmp_path / "plan.json").read_text())
    out = tmp_path / "out"
    assert kq("convert", tiny, "-t", "950dt", "-o", out, "-q").returncode == 0
    r = kq("verify", out, "-q", "--json", tmp_path / "verify.json")
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stderr
    v = json.loads((tmp_path / "verify.json").read_text())
    assert v["model_quant_type"] == plan["totals"]["model_quant_type"]
    assert v["bytes"] == plan["totals"]["out_bytes"]
    assert v["shards"] == len(plan["units"]) == len(list(out.glob("quant_model_weights-*.safetensors")))
    assert v["ok"] is True and v["error"] is None and v["exit_code"] == 0
    # a damaged output: the file says so as well as the exit code and the one line
    shard = sorted(out.glob("quant_model_weights-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = kq("verify", out, "-q", "--json", tmp_path / "verify.json")
    v = json.loads((tmp_path / "verify.json").read_text())
    assert r.returncode == 2 and v["ok"] is False and v["exit_code"] == 2
    assert v["error"] in r.stderr and shard.name in v["error"]


def test_help_defaults_of_gptq_options_are_gptqconfigs():
    """--help states --act-order's and --damp's defaults from a table that must stay GPTQConfig's."""
    import dataclasses

    from kimi_quant.calibrate.config import GPTQ_DEFAULTS
    from kimi_quant.quant.gptq import GPTQConfig

    fields = {f.name: f.default for f in dataclasses.fields(GPTQConfig)}
    assert GPTQ_DEFAULTS == {k: fields[k] for k in GPTQ_DEFAULTS}
    out = CliRunner().invoke(main, ["convert", "--help"], terminal_width=200).output
    assert f"[default: {GPTQ_DEFAULTS['damp']}]" in out and "measured default" not in out


def test_convert_help_lists_output_right_after_target():
    out = CliRunner().invoke(main, ["convert", "--help"], terminal_width=200).output
    names = [line.split()[0].rstrip(",") for line in out.splitlines() if line.startswith("  -")]
    assert names[:2] == ["-t", "-o"]
