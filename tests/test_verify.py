"""``kimi-quant verify DIR``: passes on a good output; one line and exit != 0 for each kind of damage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import JOURNAL_NAME, error_line, fresh_copy, kq, target_args

DESC = "quant_model_description.json"
INDEX = "quant_model_weights.safetensors.index.json"
PROV = "kimi_quant_provenance.json"


@pytest.fixture(scope="module", params=["950dt", "a3"])
def good(request, tiny_source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"verify_{request.param}") / "out"
    r = kq("convert", tiny_source, *target_args(request.param), "-o", out, "-q", "--max-shard-size", "500KB")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture
def out(good, tmp_path) -> Path:
    return fresh_copy(good, tmp_path, "out")


def shards(d: Path) -> list[Path]:
    return sorted(d.glob("quant_model_weights-*.safetensors"))


def fails(d: Path, *extra) -> str:
    r = kq("verify", d, *extra)
    assert r.returncode != 0, r.stdout
    return error_line(r.stderr)


def test_passes_on_a_good_output(good):
    r = kq("verify", good)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok: ") and len(shards(good)) > 1
    meaning = r.stdout.splitlines()[1]  # what model_quant_type means, in one line
    if "a3" in good.parent.name:
        assert "model_quant_type W8A8_DYNAMIC" in meaning and "routed experts are W4A8_DYNAMIC" in meaning
    else:
        assert "model_quant_type W4A8_MXFP: the highest type present" in meaning


def test_a_moe_layers_experts_key_must_match_its_experts(out):
    desc = json.loads((out / DESC).read_text())
    key = "language_model.model.layers.2.block_sparse_moe.experts.weight"
    desc[key] = "FLOAT"
    (out / DESC).write_text(json.dumps(desc))
    assert f"'{key}' is 'FLOAT', the layer's experts are" in fails(out, "--no-rehash")
    del desc[key]
    (out / DESC).write_text(json.dumps(desc))
    assert "is None, the layer's experts are" in fails(out, "--no-rehash")


def test_flipped_byte_in_a_shard(out):
    victim = shards(out)[1]
    data = bytearray(victim.read_bytes())
    data[len(data) * 2 // 3] ^= 0x01
    victim.write_bytes(bytes(data))
    line = fails(out)
    assert victim.name in line and "sha256" in line


def test_flipped_byte_without_rehash_still_checks_headers(out):
    victim = shards(out)[0]
    data = bytearray(victim.read_bytes())
    data[12] ^= 0x55  # inside the JSON header
    victim.write_bytes(bytes(data))
    line = fails(out, "--no-rehash")
    assert victim.name in line


def test_missing_shard(out):
    victim = shards(out)[-1]
    victim.unlink()
    line = fails(out)
    assert victim.name in line and "missing" in line


def test_truncated_shard(out):
    victim = shards(out)[0]
    victim.write_bytes(victim.read_bytes()[:-10])
    line = fails(out, "--no-rehash")
    assert victim.name in line


@pytest.mark.parametrize("edit", ["retype", "model_quant_type", "drop", "whitespace"])
def test_edited_description(out, edit):
    path = out / DESC
    desc = json.loads(path.read_text())
    name = next(k for k, v in desc.items() if v != "FLOAT" and k.endswith(".weight") and isinstance(v, str)
                and k not in ("version", "model_quant_type"))
    if edit == "retype":
        desc[name] = "FLOAT"
    elif edit == "model_quant_type":
        desc["model_quant_type"] = "FLOAT"
    elif edit == "drop":
        del desc[name]
    if edit == "whitespace":
        path.write_text(path.read_text() + "\n")
    else:
        path.write_text(json.dumps(desc, indent=2))
    line = fails(out)
    assert DESC in line
    # without the recorded hash (--no-rehash) the semantic checks still catch real edits
    if edit != "whitespace":
        fails(out, "--no-rehash")


def test_edited_index(out):
    path = out / INDEX
    index = json.loads(path.read_text())
    name = sorted(index["weight_map"])[0]
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"][name] = next(f for f in files if f != index["weight_map"][name])
    path.write_text(json.dumps(index))
    assert INDEX in fails(out)


def test_config_with_quantization_config(out):
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    (out / "config.json").write_text(json.dumps(cfg))
    assert "config.json" in fails(out)


def test_provenance_from_another_conversion(out):
    prov = json.loads((out / PROV).read_text())
    prov["plan_fingerprint"] = "0" * 64
    (out / PROV).write_text(json.dumps(prov))
    assert PROV in fails(out)


def test_validation_may_amend_provenance(out):
    prov = json.loads((out / PROV).read_text())
    prov["validation"] = {"passed": True}
    (out / PROV).write_text(json.dumps(prov, indent=2))
    assert kq("verify", out).returncode == 0


def test_incomplete_conversion(out):
    path = out / JOURNAL_NAME
    lines = path.read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["kind"] == "complete"
    path.write_text("".join(lines[:-1]))
    # how far it got, and the command that finishes it (from the options the journal recorded)
    total = json.loads(lines[0])["units"]
    assert total == len(shards(out)) > 1
    line = fails(out)
    assert f"conversion incomplete ({total} of {total} shards written; the command that finishes it: " \
           f"kimi-quant convert " in line and f"--output {out}" in line, line
    # the last shard's record gone too: one fewer written
    path.write_text("".join(ln for ln in lines[:-1] if ln != max(
        (ln for ln in lines if json.loads(ln)["kind"] == "unit"), key=lambda ln: json.loads(ln)["file"])))
    assert f"({total - 1} of {total} shards written;" in fails(out)
    # a journal from before the count, or with a hostile one, still says how many are written
    start = json.loads(lines[0])
    for units in (None, "10", True, -1):
        rest = path.read_text().splitlines(keepends=True)[1:]
        path.write_text(json.dumps({**start, "units": units}) + "\n" + "".join(rest))
        assert f"({total - 1} shards written;" in fails(out)
    # no recorded options (an older journal): the generic advice
    path.write_text(json.dumps({k: v for k, v in start.items() if k != "options"}) + "\n" + "".join(rest))
    assert "shards written; re-run the same convert command to finish it)" in fails(out)


def test_no_journal(out):
    (out / JOURNAL_NAME).unlink()
    assert "journal" in fails(out)


def test_not_a_directory(tmp_path):
    line = fails(tmp_path / "nope")
    assert "nope" in line
