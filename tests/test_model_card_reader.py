"""The model card as a hub reader sees it: front matter the hub understands (base_model, the source's licence,
tags, pipeline tag), a title from the source model's name (a local source: its card's title; its path or
directory name is never recorded), the CLI's counts and sizes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from conftest import kq

from kimi_quant.layout.ascend_v1 import PROVENANCE
from kimi_quant.layout.model_card import model_card, source_card_front_matter

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "kimi_quant" / "model" / "fixtures" / "tiny"
SOURCE_CARD = """---
license: other
license_name: modified-mit
library_name: transformers
pipeline_tag: text-generation
tags:
- kimi
---
# Kimi tiny
"""


def front_matter(card: str) -> list[str]:
    lines = card.splitlines()
    assert lines[0] == "---"
    return lines[1:lines.index("---", 1)]


def test_card_reads_like_a_hub_card(tmp_path):
    src = tmp_path / "Kimi-Tiny"
    shutil.copytree(FIXTURE, src)
    (src / "README.md").write_text(SOURCE_CARD)
    out = tmp_path / "out"
    r = kq("convert", src, "-t", "950dt", "-o", out)
    assert r.returncode == 0, r.stderr
    cli_counts = dict(re.findall(r"(\w+) (\d+)", r.stdout.split("tensors: ", 1)[1].splitlines()[0]))
    cli_size = re.search(r"-> output (\S+ [MG]B) in (\d+) shard", r.stdout)
    card = (out / "README.md").read_text()

    meta = front_matter(card)
    assert "license: other" in meta and "license_name: modified-mit" in meta  # copied from the source's card
    assert "pipeline_tag: text-generation" in meta and "- kimi-quant" in meta and "- w4a8_mxfp" in meta
    assert not any(m.startswith("base_model") for m in meta)  # a local source is no hub model
    assert "# Kimi tiny for Ascend 950DT (W4A8 MXFP)" in card  # the source card's own title
    assert str(tmp_path) not in card and "Kimi-Tiny" not in card and "| Source | `local checkpoint` |" in card
    assert "| Tensors per scheme | " + ", ".join(f"{s}: {n}" for s, n in sorted(cli_counts.items())) + " |" in card
    assert f"| Weights | {cli_size[1]} in 1 shard (" in card and "1 shards" not in card
    assert "the highest type present (msModelSlim's convention)" in card  # what model quant type means
    assert "NZ" not in card and " ND " not in card
    assert "hf download ORG/NAME" in card and card.count("hf download") == 1  # a placeholder, marked as one


def test_published_card_names_the_repo_and_the_base_model(tmp_path):
    out = tmp_path / "out"
    assert kq("convert", FIXTURE, "-t", "a3", "-o", out, "-q").returncode == 0
    prov = json.loads((out / PROVENANCE).read_text())
    (out / PROVENANCE).write_text(json.dumps({**prov, "source": "moonshotai/Kimi-K3", "revision": "0" * 40}))
    card = model_card(out, repo_id="my-org/Kimi-K3-W4A8")
    meta = front_matter(card)
    assert "base_model: moonshotai/Kimi-K3" in meta and "base_model_relation: quantized" in meta
    assert "# Kimi-K3 for Atlas 800I A3 / Atlas 900 A3 SuperPoD (W4A8 integer)" in card
    assert "\nhf download my-org/Kimi-K3-W4A8 --local-dir ./model\n" in card
    assert "W4A8_DYNAMIC never counts" in card  # an a3 card explains its W8A8_DYNAMIC model quant type


def test_source_front_matter_reader():
    assert source_card_front_matter(SOURCE_CARD) == {"license": "other", "license_name": "modified-mit",
                                                     "library_name": "transformers",
                                                     "pipeline_tag": "text-generation"}
    assert source_card_front_matter("# no front matter\nlicense: mit\n") == {}
    assert source_card_front_matter("---\nlicense: mit\n") == {}  # never closed
