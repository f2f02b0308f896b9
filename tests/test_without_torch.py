"""PyTorch is optional: converting, planning, verifying and publishing run without it; what runs the
model (validate, --validate, --calibrate) is refused in one line before anything is written.

Each CLI here runs with ``torch`` made unimportable for the process and its workers (a sitecustomize
on PYTHONPATH), so an import of torch anywhere on those paths fails the test."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import kq

TINY = Path(__file__).resolve().parents[1] / "kimi_quant" / "model" / "fixtures" / "tiny"


@pytest.fixture
def no_torch(tmp_path) -> dict:
    site = tmp_path / "no-torch-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None  # import torch -> ImportError\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}


def test_the_blocker_works(no_torch):
    r = kq("--version", env=no_torch)
    assert r.returncode == 0
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "import torch"], env={**os.environ, **no_torch}, capture_output=True)
    assert r.returncode != 0 and b"import of torch halted" in r.stderr


@pytest.mark.parametrize("target", ["a3", "950dt"])
def test_convert_plan_verify_run_without_torch(tmp_path, no_torch, target):
    out = tmp_path / target
    r = kq("plan", TINY, "-t", target, env=no_torch)
    assert r.returncode == 0, r.stderr
    r = kq("convert", TINY, "-t", target, "-o", out, "--workers", "2", "-q", env=no_torch)
    assert r.returncode == 0, r.stderr
    r = kq("verify", out, "--json", tmp_path / f"{target}.json", env=no_torch)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / f"{target}.json").read_text())["tensors"] > 500


@pytest.mark.parametrize("args", [
    ["convert", TINY, "-t", "a3", "-o", "{out}", "--calibrate"],
    ["convert", TINY, "-t", "950dt", "-o", "{out}", "--validate"],
    ["plan", TINY, "-t", "a3", "--calibrate"],
], ids=["calibrate", "convert-validate", "plan-calibrate"])
def test_what_runs_the_model_is_refused_in_one_line(tmp_path, no_torch, args):
    out = tmp_path / "out"
    r = kq(*[str(a).replace("{out}", str(out)) for a in args], env=no_torch)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "PyTorch, which is not installed: pip install torch" in r.stderr
    assert not out.exists()


def test_validate_is_refused_and_the_demo_says_what_it_skipped(tmp_path, no_torch):
    r = kq("demo", "-o", tmp_path / "demo", env=no_torch, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "not validated: validation runs the model in PyTorch" in r.stdout
    for name in ("tiny-a3", "tiny-950dt", "tiny-released-950dt"):
        assert (tmp_path / "demo" / name / "quant_model_description.json").exists()
    r = kq("validate", tmp_path / "demo" / "tiny-bf16", tmp_path / "demo" / "tiny-a3", env=no_torch)
    assert r.returncode == 2 and "validate runs the model in PyTorch" in r.stderr
    assert not (tmp_path / "demo" / "tiny-a3" / "kimi_quant_validation.json").exists()
