"""End to end: synth the tiny fixture, convert it for a3 and 950dt, validate (ppl ratio in a sane band)."""

from pathlib import Path

import pytest
import torch

convert_mod = pytest.importorskip("kimi_quant.convert")

from kimi_quant.synth import synth  # noqa: E402
from kimi_quant.validate.run import run_validation  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return synth("tiny", tmp_path_factory.mktemp("src") / "tiny-bf16")


@pytest.mark.parametrize("target", ["a3", "950dt"])
def test_convert_then_validate(source, tmp_path, target):
    out = tmp_path / target
    convert_mod.convert(str(source), convert_mod.ConvertOptions(target=target, output=Path(out), quiet=True, workers=1))
    rep = run_validation(source, out, max_tokens=1024, seq_len=256, progress=False)
    assert 1.0 <= rep["ratio"] < 1.5, rep["ratio"]
    assert rep["ppl_bf16"] < 20
    assert len(rep["layers"]) == 6
    # errors grow with depth but stay bounded; quantized outputs still point the same way
    assert all(e["cosine"] > 0.9 for e in rep["layers"])
    assert rep["logits"]["cosine"] > 0.98
