"""The wheel carries what an installed kimi-quant needs away from a checkout: the recipe, the tiny
fixture model and the shipped calibration splits (validate's default text), and nothing of
calibration/src (CPython modules kept there as calibration text, not code to install)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_ok() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 68


@pytest.mark.skipif(not _setuptools_ok(), reason="needs setuptools>=68 (the test extra installs it)")
def test_wheel_ships_data_files(tmp_path):
    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ and *.egg-info in the checkout
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".*", "build", "*.egg-info", "__pycache__", "tests", "kimi-quant-demo"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("kimi_quant-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = "kimi_quant/runtime/calibration_data/"
    for split in ("heldout.jsonl", "train.jsonl", "README.md"):
        got = zipfile.ZipFile(wheel).read(data + split)
        assert got == (ROOT / "calibration" / split).read_bytes(), split
    assert {"kimi_quant/recipe/kimi_k3.toml", "kimi_quant/model/fixtures/tiny/model.safetensors"} <= names
    assert not [n for n in names if "stdlib" in n or n.startswith(data + "src")]
    assert not [n for n in names if n.endswith(".py") and not n.startswith("kimi_quant/")]
