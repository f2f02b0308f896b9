"""CLI error contract: one line ``kimi-quant: error: ...`` on stderr, exit != 0, nothing written."""

from __future__ import annotations

import pytest

import interrupt_in_exec
from conftest import error_line, kq, target_args


def refused(tmp_path, *args) -> str:
    out = tmp_path / "out"
    r = kq(*args)
    assert r.returncode != 0, r.stdout
    line = error_line(r.stderr)
    assert not out.exists() or not any(out.iterdir()), "a refused run wrote something"
    return line


@pytest.mark.parametrize("target,words", [("a2", ["a2", "not yet supported", "a3", "950dt"]),
                                          ("950pr", ["950pr", "not yet supported"]),
                                          ("foo", ["foo", "a3", "950dt"])])
def test_unsupported_or_unknown_target(tiny_source, tmp_path, target, words):
    line = refused(tmp_path, "convert", tiny_source, "-t", target, "-o", tmp_path / "out")
    for w in words:
        assert w in line


@pytest.mark.parametrize("alias", ["A3", "atlas-a3", "800i-a3", "950DT", "ascend-950dt"])
def test_target_aliases_plan(tiny_source, alias):
    r = kq("plan", tiny_source, "-t", alias, "--no-shards")
    assert r.returncode == 0, r.stderr
    meaning = next(ln for ln in r.stdout.splitlines() if ln.startswith("quant "))[len("quant "):].strip()
    want = ("model_quant_type W8A8_DYNAMIC: msModelSlim's convention (W4A8_DYNAMIC never counts)"
            if "a3" in alias.lower() else "model_quant_type W4A8_MXFP: the highest type present")
    assert meaning.startswith(want), r.stdout


def test_missing_recipe_file(tiny_source, tmp_path):
    line = refused(tmp_path, "convert", tiny_source, "-t", "a3", "--recipe", tmp_path / "none.toml", "-o", tmp_path / "out")
    assert "none.toml" in line


def test_recipe_not_toml(tiny_source, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("this is [ not toml\n")
    line = refused(tmp_path, "convert", tiny_source, "-t", "a3", "--recipe", bad, "-o", tmp_path / "out")
    assert "bad.toml" in line and "TOML" in line


def test_override_without_equals(tiny_source, tmp_path):
    line = refused(tmp_path, "convert", tiny_source, "-t", "a3", "--override", "noequals", "-o", tmp_path / "out")
    assert "noequals" in line


def test_override_unknown_scheme(tiny_source, tmp_path):
    line = refused(tmp_path, "convert", tiny_source, "-t", "a3", "--override", "*=INT3", "-o", tmp_path / "out")
    assert "INT3" in line


def test_source_not_a_checkpoint(tmp_path):
    src = tmp_path / "empty"
    src.mkdir()
    line = refused(tmp_path, "convert", src, "-t", "a3", "-o", tmp_path / "out")
    assert "empty" in line


def test_source_without_config(tiny_source, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_source, src)
    (src / "config.json").unlink()
    line = refused(tmp_path, "convert", src, "-t", "a3", "-o", tmp_path / "out")
    assert "config.json" in line


@pytest.mark.parametrize("spec", ["./no-such-dir", "/tmp/kq-no-such-dir/x"])
def test_mistyped_local_path(tmp_path, spec):
    line = refused(tmp_path, "convert", spec, "-t", "a3", "-o", tmp_path / "out")
    assert spec in line


def test_verify_on_a_source_checkpoint(tiny_source):
    r = kq("verify", tiny_source)
    assert r.returncode != 0
    assert "journal" in error_line(r.stderr)


def test_output_is_a_file(tiny_source, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    r = kq("convert", tiny_source, *target_args("a3"), "-o", f, "-q")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert f.read_text() == "x"


def test_the_program_ignores_ctrl_c_once_its_command_is_over(monkeypatch):
    """A Ctrl-C in the interpreter's teardown (the pool's exit handler joining its threads) killed a
    finished run by SIGINT, without a word (tests/test_resume.py::test_ctrl_c_during_start_up_is_one_line
    caught it now and then): the program ignores SIGINT once the CLI has chosen its exit status."""
    import signal
    import sys

    from kimi_quant import cli

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(sys, "argv", ["kimi-quant", "--version"])
    try:
        with pytest.raises(SystemExit) as e:
            cli.run()
        assert e.value.code in (0, None)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_in_exec_code_exits_130(tmp_path):
    """A Ctrl-C that lands while Python runs code ``exec`` built from a string (here: a dataclass of the
    module `targets` imports) is one line and exit 130, as anywhere else: CPython flags such a
    KeyboardInterrupt as unhandled even though the CLI catches it, and under ``python -m`` it used to kill
    itself with SIGINT after exiting (returncode -2)."""
    mark = tmp_path / "fired"
    r = interrupt_in_exec.run(["targets"], "kimi_quant.targets", mark)
    assert mark.read_text() == "kimi_quant.targets"
    assert r.returncode == 130, r.stderr
    assert r.stderr.splitlines() == ["kimi-quant: interrupted"], r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("target", ["foo", "950dt"])
def test_convert_pauses_the_collector_while_it_loads_only(tiny_source, tmp_path, monkeypatch, target):
    """``convert`` turns garbage collection off while the converter loads (start-up time, with one
    core working alone) and back on before converting, on success and on a refused target alike: an
    in-process caller (a notebook, these tests) keeps its collector."""
    import gc

    from click.testing import CliRunner

    from kimi_quant import cli, targets

    seen = []
    real = targets.resolve_target
    monkeypatch.setattr(targets, "resolve_target", lambda t: (seen.append(gc.isenabled()), real(t))[1])
    assert gc.isenabled()
    r = CliRunner().invoke(cli.main, ["convert", str(tiny_source), "-t", target, "-o", str(tmp_path / "out"),
                                      "-q", "--workers", "1"])
    assert (r.exit_code == 0) == (target == "950dt"), r.output
    assert seen[0] is False  # the first call: convert checks the target before anything else
    assert gc.isenabled()


def test_a_kimi_quant_output_given_as_the_source_is_named_so(tiny_source, tmp_path):
    out = tmp_path / "a3"
    assert kq("convert", tiny_source, "-t", "a3", "-o", out, "-q").returncode == 0
    for cmd in (["plan", out, "-t", "950dt"], ["convert", out, "-t", "950dt", "-o", tmp_path / "again"]):
        r = kq(*cmd)
        assert r.returncode == 2
        line = error_line(r.stderr)
        assert "already quantized (by kimi-quant for a3, ascendV1" in line and "made from" in line, line
    assert not (tmp_path / "again").exists()
