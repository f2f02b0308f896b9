"""Issue 31, classes 6, 7 and 9's provenance: a validation is bound to what it measured (the output's
digest, the source's identity) and covered by the journal; another checkpoint is refused, and with --force
shown but never recorded; published files carry no local path. Through the real CLI."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import error_line, kq  # noqa: E402

from kimi_quant.layout.ascend_v1 import PROVENANCE, VALIDATION  # noqa: E402
from kimi_quant.synth import synth  # noqa: E402

VALIDATE = ("--max-tokens", "512", "--seq-len", "128", "-q")


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    """(source, output): the tiny BF16 source and its a3 conversion, validated."""
    base = tmp_path_factory.mktemp("val")
    src = synth("tiny", base / "tiny-bf16")
    out = base / "out"
    r = kq("convert", src, "-t", "a3", "-o", out, "-q")
    assert r.returncode == 0, r.stderr
    r = kq("validate", src, out, *VALIDATE)
    assert r.returncode == 0, r.stderr
    return src, out


def _copy(validated, tmp_path) -> Path:
    """A copy of the validated output (its journal still names the module's source, left unchanged)."""
    o = tmp_path / "out"
    shutil.copytree(validated[1], o)
    return o


def _own(tmp_path) -> tuple[Path, Path]:
    """A source and its validated output of this test's own (the test changes the source)."""
    src = synth("tiny", tmp_path / "tiny-bf16")
    out = tmp_path / "out"
    assert kq("convert", src, "-t", "a3", "-o", out, "-q").returncode == 0
    assert kq("validate", src, out, *VALIDATE).returncode == 0
    return src, out


def test_a_validated_output_says_so_and_publishes_no_local_path(validated):
    src, out = validated
    v = kq("verify", out)
    assert v.returncode == 0 and "validated: perplexity" in v.stdout, v.stdout + v.stderr
    for name in (PROVENANCE, VALIDATION, "README.md"):
        text = (out / name).read_text()
        assert str(src) not in text and str(out) not in text, name
    assert json.loads((out / PROVENANCE).read_text())["source"] == "local checkpoint"


def test_a_changed_source_config_voids_the_validation_on_reconvert(validated, tmp_path):
    """eps changed in the source config: convert keeps the shards, rewrites config.json; the old
    numbers would describe another model (re-validating gives other ones)."""
    src, out = _own(tmp_path)
    shards = {p.name: p.stat().st_mtime_ns for p in out.glob("quant_model_weights-*")}
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = 0.5
    (src / "config.json").write_text(json.dumps(config))
    r = kq("convert", src, "-t", "a3", "-o", out, "-q")
    assert r.returncode == 0, r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("quant_model_weights-*")} == shards  # kept
    assert "its validation was of other files" in r.stderr
    assert json.loads((out / "config.json").read_text())["text_config"]["rms_norm_eps"] == 0.5
    assert not (out / VALIDATION).exists() and "validation" not in json.loads((out / PROVENANCE).read_text())
    v = kq("verify", out)
    assert v.returncode == 0 and "validated: perplexity" not in v.stdout and "not validated" in v.stdout
    assert "Perplexity BF16" not in (out / "README.md").read_text()


def test_a_source_changed_after_validation_voids_it(tmp_path):
    src, out = _own(tmp_path)
    assert "validated: perplexity" in kq("verify", out).stdout
    shard = next(src.glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data)  # rewritten in place (same bytes here; any rewrite is a new file to the journal)
    v = kq("verify", out)
    assert v.returncode == 0 and "validated: perplexity" not in v.stdout
    assert "void (the source changed since it was validated)" in v.stdout, v.stdout


def test_an_edited_verdict_fails_verify(validated, tmp_path):
    out = _copy(validated, tmp_path)
    prov = json.loads((out / PROVENANCE).read_text())
    prov["validation"]["ppl_quant"] = prov["validation"]["ppl_bf16"]
    prov["validation"]["ratio"] = 1.0
    (out / PROVENANCE).write_text(json.dumps(prov, indent=2))
    v = kq("verify", out)
    assert v.returncode == 2 and f"{PROVENANCE}: sha256 differs" in error_line(v.stderr)


def test_a_report_of_other_files_is_void(validated, tmp_path):
    """A report copied in from another output (or a verdict rewritten to match it) is not this output's."""
    out = _copy(validated, tmp_path)
    report = json.loads((out / VALIDATION).read_text())
    report["inputs"]["output_sha256"] = "0" * 64
    (out / VALIDATION).write_text(json.dumps(report))
    journal = out / "kimi_quant_journal.jsonl"
    from kimi_quant.journal import Journal

    j = Journal(out)
    j.mark_complete(sorted(j.metadata))  # as if the journal had recorded it: only the binding is left to notice
    v = kq("verify", out)
    assert v.returncode == 0 and "void (the output changed since it was validated)" in v.stdout, v.stdout
    assert journal.exists()


def test_validating_against_another_checkpoint_is_refused_and_never_recorded(validated, tmp_path):
    """A same-shaped random checkpoint: before, a warning and then "validated: -99.92%"."""
    out = _copy(validated, tmp_path)
    other = synth("tiny", tmp_path / "other", seed=7, random_weights=True)
    before = (out / VALIDATION).read_bytes()
    r = kq("validate", other, out, *VALIDATE)
    line = error_line(r.stderr)
    assert r.returncode == 2 and "not the checkpoint the output was converted from" in line, line
    assert r.stdout == ""  # no numbers shown as if they were about this output
    assert (out / VALIDATION).read_bytes() == before
    r = kq("validate", other, out, *VALIDATE, "--force")
    assert "cosine" in r.stdout and "report written" not in r.stdout, r.stdout
    assert "not recorded" in r.stderr
    assert (out / VALIDATION).read_bytes() == before
    v = kq("verify", out)
    assert "validated: perplexity" in v.stdout and "-99" not in v.stdout


def test_verify_into_a_closed_pipe_is_quiet(validated):
    """`kimi-quant verify X | head -1`: the reader leaves after one line; no "error: Broken pipe", exit 0."""
    _, out = validated
    import subprocess

    cli = f"{sys.executable} -m kimi_quant.cli verify {out}"
    r = subprocess.run(["bash", "-c", f"{cli} | head -1; echo status ${{PIPESTATUS[0]}} >&2"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=300)
    assert r.stdout.startswith("ok: ") and r.stdout.count("\n") == 1
    assert "Broken pipe" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.split()[-2:] in (["status", "0"], ["status", "141"]), r.stderr
    # a reader that never reads: the first line already meets a closed pipe
    r = subprocess.run(["bash", "-c", f"{cli} | (exec 0<&-; sleep 0); echo status ${{PIPESTATUS[0]}} >&2"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=300)
    assert r.stderr.strip() in ("status 141", "status 0"), r.stderr
