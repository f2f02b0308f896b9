"""Issue 13: hostile inputs (symlinks, path names, races, huge numbers, damaged bytes), each tried for real.

Every case runs the real CLI (or the real library call) against a checkpoint edited to be hostile and
asserts the one-line refusal and that nothing outside the named directories was read, written or deleted.
Hub cases use the project's fake hub (tests/hubtools/fake_hub.py, the real HTTP protocol and the real
huggingface_hub client): olah serves git repos, which can neither hold a file named ``../x`` nor damage
bytes in transit.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import JOURNAL_NAME, error_line, fresh_copy, kq, kq_popen, looks_loadable  # noqa: E402
from hubtools.fake_hub import FakeHub  # noqa: E402

from kimi_quant.errors import KimiQuantError  # noqa: E402
from kimi_quant.source.safetensors import SafetensorsReader  # noqa: E402
from kimi_quant.write import ShardWriter, write_json_atomic  # noqa: E402

INDEX = "model.safetensors.index.json"
PROVENANCE = "kimi_quant_provenance.json"
EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"
NORM = "language_model.model.layers.0.input_layernorm.weight"


def convert(src, out, target="950dt", *extra):
    return kq("convert", src, "-t", target, "-o", out, "-q", *extra)


def plan(src, *extra):
    return kq("plan", src, "-t", "950dt", "--no-shards", *extra)


# -- editing a checkpoint ---------------------------------------------------------------------------------
def load(src: Path) -> tuple[dict, dict]:
    """(index, {file: {tensor: (dtype, shape, array)}}) of a checkpoint."""
    index = json.loads((src / INDEX).read_text())
    shards = {}
    for f in sorted(set(index["weight_map"].values())):
        with SafetensorsReader(src / f) as r:
            shards[f] = {n: (t.dtype, list(t.shape), np.array(r.array(n))) for n, t in sorted(r.tensors.items(),
                                                                                           key=lambda kv: kv[1].start)}
    return index, shards


def save(src: Path, index: dict, shards: dict) -> None:
    for f, tensors in shards.items():
        w = ShardWriter(src / f, [(n, dt, tuple(shape)) for n, (dt, shape, _) in tensors.items()])
        for n, (_, _, arr) in tensors.items():
            w.write(n, arr)
        w.commit()
    write_json_atomic(src / INDEX, index)


def where(index: dict, name: str) -> str:
    return index["weight_map"][name]


@pytest.fixture
def src(tiny_source, tmp_path) -> Path:
    return fresh_copy(tiny_source, tmp_path, "src")


# -- 1: a symlink out of the source --------------------------------------------------------------------------
def test_a_link_out_of_the_source_is_never_read_or_copied(src, tmp_path):
    secret = tmp_path / "private" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text("PRIVATE KEY\n")
    (src / "special_tokens_map.json").symlink_to(secret)
    out = tmp_path / "out"
    r = convert(src, out)
    assert r.returncode == 2
    line = error_line(r.stderr)
    assert f"{src / 'special_tokens_map.json'}: links to {secret}, outside the source directory" in line
    assert not any("PRIVATE" in p.read_text(errors="replace") for p in out.rglob("*") if p.is_file())
    # a folder link is not followed either when the index names a shard through it
    (src / "special_tokens_map.json").unlink()
    (src / "sub").symlink_to(tmp_path / "private", target_is_directory=True)
    (tmp_path / "private" / "x.safetensors").write_bytes((src / "model-00001-of-00004.safetensors").read_bytes())
    index = json.loads((src / INDEX).read_text())
    index["weight_map"] = {k: ("sub/x.safetensors" if v.endswith("00001-of-00004.safetensors") else v)
                           for k, v in index["weight_map"].items()}
    (src / INDEX).write_text(json.dumps(index))
    r = plan(src)
    assert r.returncode == 2 and "'sub/x.safetensors', which is not a file of the checkpoint" in error_line(r.stderr)


def test_publish_refuses_a_link_out_of_the_output(src, tmp_path):
    from kimi_quant.publish import publish

    out = tmp_path / "out"
    assert convert(src, out).returncode == 0
    secret = tmp_path / "secret.txt"
    secret.write_text("do not upload")
    (out / "notes.txt").symlink_to(secret)
    hub = FakeHub(tmp_path / "hub")
    try:
        with pytest.raises(KimiQuantError, match="outside .*refusing to publish it"):
            publish(out, "me/model", endpoint=hub.endpoint, retries=1, include=("notes.txt",))
        assert not hub.exists("me/model")  # refused before the repo was even created
    finally:
        hub.close()


# -- 2: index entries out of the source -------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["../outside.safetensors", "/abs/outside.safetensors", "a/./b.safetensors"])
def test_an_index_naming_files_outside_is_refused(src, tmp_path, bad):
    if bad.startswith("../"):
        (tmp_path / "outside.safetensors").write_bytes((src / "model-00001-of-00004.safetensors").read_bytes())
    index = json.loads((src / INDEX).read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = bad
    (src / INDEX).write_text(json.dumps(index))
    r = plan(src)
    assert r.returncode == 2
    assert f"maps to {bad!r}, which" in error_line(r.stderr) and "inside the checkpoint" in r.stderr


# -- 3: hub file names out of the work dir ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["../../x", "sub/../../x", "/abs/x"])
def test_hub_file_names_leading_out_are_refused_before_any_write(tmp_path, bad, monkeypatch):
    hub = FakeHub(tmp_path / "hub")
    try:
        hub.create("org/evil", private=False)
        files = {n: hub.file_entry(d, lfs=False) for n, d in
                 {"config.json": b'{"model_type": "kimi_k3"}', bad: b"pwned", "README.md": b"hi"}.items()}
        hub.new_commit("org/evil", "main", hub.resolve("org/evil", "main"), files, "evil")
        work = tmp_path / "deep" / "er" / "work"
        r = kq("convert", "org/evil", "-t", "950dt", "-o", tmp_path / "out", "--work-dir", work,
               env={"HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1"})
        assert r.returncode == 2
        assert f"the repo lists a file named {bad!r}" in error_line(r.stderr)
        assert not any(p.read_bytes() == b"pwned" for p in tmp_path.rglob("*") if p.is_file()
                       and "hub" not in p.relative_to(tmp_path).parts)
        assert not (tmp_path / "out").exists()
    finally:
        hub.close()


# -- 4: --overwrite deletes only what kimi-quant wrote ---------------------------------------------------------------
def test_overwrite_keeps_what_kimi_quant_did_not_write(src, tmp_path):
    out = tmp_path / "out"
    assert convert(src, out, "a3").returncode == 0
    (out / "notes.txt").write_text("my notes")
    (out / "mine").mkdir()
    (out / "mine" / "data.bin").write_bytes(b"\0" * 10)
    victim = tmp_path / "victim.txt"  # a journal line naming a file outside must not get it deleted
    victim.write_text("keep me")
    with open(out / JOURNAL_NAME, "a") as f:
        f.write(json.dumps({"kind": "unit", "file": "../victim.txt", "size": 7, "sha256": "0" * 64}) + "\n")
    r = convert(src, out, "950dt", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert (out / "notes.txt").read_text() == "my notes" and (out / "mine" / "data.bin").exists()
    assert victim.read_text() == "keep me"
    assert "kept 2 file(s) kimi-quant did not write" in r.stderr and "notes.txt" in r.stderr
    assert kq("verify", out).returncode == 0
    # a user's file the new conversion would replace: refused, nothing touched
    (src / "extra" / "new.txt").write_text("from the source")
    (out / "extra" / "new.txt").write_text("the user's own")
    r = convert(src, out, "a3", "--overwrite")
    assert r.returncode == 2 and "new.txt was not written by kimi-quant" in error_line(r.stderr)
    assert (out / "extra" / "new.txt").read_text() == "the user's own"


# -- 5 / 15: one run per output directory -------------------------------------------------------------------------
def test_a_second_run_into_a_held_output_is_refused_naming_the_holder(src, tmp_path):
    from kimi_quant.lock import output_lock

    out = tmp_path / "out"
    out.mkdir()
    lock = output_lock(out).acquire()
    try:
        r = convert(src, out, "a3", "--overwrite")
        assert r.returncode == 2
        assert error_line(r.stderr) == (f"kimi-quant: error: {out} is being written by another kimi-quant run "
                                        f"(pid {os.getpid()}); wait for it to end, or choose another --output")
    finally:
        lock.release()
    assert sorted(p.name for p in out.iterdir()) == []  # refused before anything was written


def test_two_runs_at_once_one_refused_the_other_complete(mid_source, tmp_path):
    """The issue's race: a3, then 950dt --overwrite while it runs (and two identical runs). The first run is
    paused (SIGSTOP) once it holds the directory, so the others surely meet it there."""
    import signal

    out = tmp_path / "out"
    first = kq_popen("convert", mid_source, "-t", "a3", "-o", out, "-q", "--workers", "1", "--max-shard-size", "1MB")
    deadline = time.monotonic() + 120
    while not (out / JOURNAL_NAME).exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    if first.poll() is not None:
        pytest.skip("the first run ended before it could be paused")
    os.kill(first.pid, signal.SIGSTOP)
    try:
        for args in (("-t", "950dt", "--overwrite"), ("-t", "a3")):
            r = kq("convert", mid_source, *args, "-o", out, "-q", "--max-shard-size", "1MB")
            assert r.returncode == 2, r.stderr
            assert f"is being written by another kimi-quant run (pid {first.pid})" in error_line(r.stderr)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert kq("verify", out).returncode == 0
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert "W4A8_DYNAMIC" in desc.values() and "W4A8_MXFP" not in desc.values()  # a3 only, no mix
    assert not (out / ".kimi_quant.lock").exists()


# -- 6: a scheme on a non-Linear ------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", ["*embed_tokens.weight", "*.layers.0.self_attention_res_proj.weight"])
def test_a_scheme_on_a_non_linear_is_refused(src, pattern):
    r = plan(src, "--override", f"{pattern}=W8A8_MXFP8")
    assert r.returncode == 2
    assert "is not a Linear layer's weight" in error_line(r.stderr)


# -- 7: the config against the tensors ----------------------------------------------------------------------------
def _move_to_other_shard(index, shards, name, keep_in_index=True, copy=False):
    f = where(index, name)
    other = next(s for s in shards if s != f)
    shards[other][name] = shards[f][name]
    if not copy:
        del shards[f][name]
    if not keep_in_index:
        del index["weight_map"][name]


def _edit_tensor(name, dtype=None, shape=None):
    def edit(index, shards):
        f = where(index, name)
        dt, shp, arr = shards[f][name]
        if dtype == "F8_E4M3":
            arr = np.zeros(arr.shape, np.uint8)
        elif dtype == "I16":
            arr = arr.view(np.int16)
        elif shape is not None:
            arr = np.zeros(int(np.prod([int(s) for s in shape])), arr.dtype)
        shards[f][name] = (dtype or dt, shape or shp, arr)
    return edit


TENSOR_CASES = {
    "in a shard, not in the index": (lambda i, s: _move_to_other_shard(i, s, NORM, keep_in_index=False),
                                     f"tensor {NORM!r} is in this shard but not in the index"),
    "in two shards": (lambda i, s: _move_to_other_shard(i, s, NORM, copy=True),
                      f"tensor {NORM!r} is also in this shard"),
    "missing": (lambda i, s: (s[where(i, NORM)].pop(NORM), i["weight_map"].pop(NORM)),
                f"tensor {NORM!r} is missing: config.json's model has it"),
    "extra": (lambda i, s: (s[where(i, NORM)].__setitem__("language_model.model.stray.weight", s[where(i, NORM)][NORM]),
                            i["weight_map"].__setitem__("language_model.model.stray.weight", where(i, NORM))),
              "tensor 'language_model.model.stray.weight' is not part of the model config.json describes"),
    "F8 norm": (_edit_tensor(NORM, dtype="F8_E4M3"), f"tensor {NORM!r} is F8_E4M3; a BF16 checkpoint holds float"),
    "I16 norm": (_edit_tensor(NORM, dtype="I16"), f"tensor {NORM!r} is I16"),
    "wrong shape": (_edit_tensor(NORM, shape=[64]), f"tensor {NORM!r} has shape [64] but config.json implies [128]"),
    "float shape": (_edit_tensor(NORM, shape=[128.0]), f"tensor {NORM!r}: malformed header entry"),
}


@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
def test_tensors_that_do_not_match_the_config_are_named(src, case):
    edit, want = TENSOR_CASES[case]
    index, shards = load(src)
    edit(index, shards)
    save(src, index, shards)
    r = plan(src)
    assert r.returncode == 2
    assert want in error_line(r.stderr)


def test_duplicate_index_keys_are_refused(src):
    text = (src / INDEX).read_text()
    first = next(iter(json.loads(text)["weight_map"].items()))
    (src / INDEX).write_text(text.replace('"weight_map": {', f'"weight_map": {{"{first[0]}": "{first[1]}", ', 1))
    r = plan(src)
    assert r.returncode == 2
    assert f"key {first[0]!r} appears twice in one object" in error_line(r.stderr)


@pytest.mark.parametrize("field,value,want", [
    ("num_hidden_layers", 1e12, "num_hidden_layers must be a whole number, got 1000000000000.0"),
    ("num_hidden_layers", -1, "num_hidden_layers = -1 is out of range"),
    ("num_hidden_layers", "6", "num_hidden_layers must be a whole number, got '6'"),
    ("num_hidden_layers", 4000, "describes at least"),  # in range, but not this checkpoint: refused before enumerating
    ("num_experts", 0, "num_experts 0 and num_experts_per_token 4"),
    ("hidden_size", True, "hidden_size must be a whole number, got True"),
])
def test_config_numbers_are_validated(src, field, value, want):
    config = json.loads((src / "config.json").read_text())
    config["text_config"][field] = value
    (src / "config.json").write_text(json.dumps(config))
    t0 = time.monotonic()
    r = plan(src)
    assert r.returncode == 2
    assert want in error_line(r.stderr)
    assert time.monotonic() - t0 < 60


# -- 8: no Inf/NaN is ever written -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,value", [("BF16", 0x7F7F), ("F32", 1e38)])
def test_weights_near_the_float_maximum_never_write_inf(src, tmp_path, dtype, value):
    index, shards = load(src)
    f = where(index, EXPERT)
    _, shape, arr = shards[f][EXPERT]
    big = np.full(shape, value, np.uint16 if dtype == "BF16" else np.float32)
    shards[f][EXPERT] = (dtype, shape, big)
    save(src, index, shards)
    out = tmp_path / "out"
    r = convert(src, out, "a3")
    assert r.returncode == 2
    line = error_line(r.stderr)
    assert f"tensor {EXPERT!r}: W4A8_DYNAMIC gives" in line and "scale_bias a NaN or Inf" in line
    assert not looks_loadable(out)


def test_verify_finds_a_nan_in_a_written_float_tensor(src, tmp_path):
    """An output whose hashes all agree (journal, provenance) but whose FLOAT tensor holds a NaN."""
    import hashlib

    out = tmp_path / "out"
    assert convert(src, out, "a3").returncode == 0
    index = json.loads((out / "quant_model_weights.safetensors.index.json").read_text())
    shard = index["weight_map"][NORM]
    with SafetensorsReader(out / shard) as r:
        start = r.info(NORM).start
    data = bytearray((out / shard).read_bytes())
    data[start:start + 2] = (0x7FC0).to_bytes(2, "little")  # a BF16 NaN
    (out / shard).write_bytes(bytes(data))
    sha = hashlib.sha256(data).hexdigest()
    lines = []
    for line in (out / JOURNAL_NAME).read_text().splitlines():
        ev = json.loads(line)
        if ev.get("kind") == "unit" and ev["file"] == shard:
            ev["sha256"] = sha
        lines.append(json.dumps(ev))
    (out / JOURNAL_NAME).write_text("\n".join(lines) + "\n")
    prov = json.loads((out / PROVENANCE).read_text())
    prov["outputs"][shard]["sha256"] = sha
    (out / PROVENANCE).write_text(json.dumps(prov))
    r = kq("verify", out)
    assert r.returncode == 2
    assert f"{shard}: tensor {NORM!r} holds a NaN or Inf" in error_line(r.stderr)


def test_verify_reads_mx_scales_as_e8m0():
    from kimi_quant.dtypes import nonfinite

    assert nonfinite(np.array([0xFF], np.uint8), "F8_E8M0") and not nonfinite(np.array([0xFE], np.uint8), "F8_E8M0")
    assert nonfinite(np.array([0x7F], np.uint8), "F8_E4M3") and not nonfinite(np.array([0x7E], np.uint8), "F8_E4M3")
    assert not nonfinite(np.array([0xFF], np.uint8), "U8")


# -- 9: zero and subnormal rows get a valid scale, without warnings ----------------------------------------------------
@pytest.mark.parametrize("scheme", ["W4A8_DYNAMIC", "W8A8_DYNAMIC", "W4A8_MXFP", "W8A8_MXFP8"])
@pytest.mark.parametrize("value", [1e-45, 1e-40, 0.0])
def test_tiny_rows_get_a_valid_scale(scheme, value):
    from kimi_quant.executor.unit import check_codec_outputs
    from kimi_quant.quant import get_codec

    w = np.full((4, 64), value, np.float32)
    w[1] = -value
    w[2] = 0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise", under="ignore"):
            out = get_codec(scheme).quantize(w, "gate")
    specs = get_codec(scheme).out_specs(w.shape, "gate")
    check_codec_outputs(scheme, [[f"t.{k}", dt, shp] for k, (dt, shp) in specs.items()], out.values(), "t")
    if out["weight_scale"].dtype == np.float32:
        assert np.all(out["weight_scale"] > 0) and np.all(np.isfinite(out["weight_scale"]))
    deq = get_codec(scheme).dequantize(out)
    assert np.all(np.isfinite(deq)) and np.abs(deq - w).max() <= 2 * abs(value) + 1e-45


def test_f32_weights_of_1e_45_convert_without_warnings(src, tmp_path):
    index, shards = load(src)
    f = where(index, EXPERT)
    _, shape, _ = shards[f][EXPERT]
    shards[f][EXPERT] = ("F32", shape, np.full(shape, 1e-45, np.float32))
    save(src, index, shards)
    for target in ("a3", "950dt"):
        out = tmp_path / f"out-{target}"
        r = kq("convert", src, "-t", target, "-o", out, "-q", env={"PYTHONWARNINGS": "error::RuntimeWarning"})
        assert r.returncode == 0, r.stderr
        assert "Warning" not in r.stderr
        assert kq("verify", out).returncode == 0
    index = json.loads((tmp_path / "out-a3" / "quant_model_weights.safetensors.index.json").read_text())
    name = EXPERT.replace(".weight", ".weight_scale")
    with SafetensorsReader(tmp_path / "out-a3" / index["weight_map"][name]) as r:
        scale = np.array(r.array(name))
    assert np.all(scale > 0) and np.all(np.isfinite(scale))


# -- 10 / 11: damaged small files and absurd Retry-After from a hub -----------------------------------------------------
@pytest.fixture
def small_repo(tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", True, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    hub = FakeHub(tmp_path / "hub")
    hub.create("org/small", private=False)
    content = {"config.json": b'{"model_type": "kimi_k3"}\n', "tokenizer_config.json": b'{"model_max_length": 8}\n'}
    hub.new_commit("org/small", "main", hub.resolve("org/small", "main"),
                   {n: hub.file_entry(d, lfs=False) for n, d in content.items()}, "small files")
    hub.content = content
    yield hub
    hub.close()


def _hub_source(hub, tmp_path, **kw):
    from kimi_quant.source.hub import HubSource

    return HubSource("org/small", endpoint=hub.endpoint, work_dir=tmp_path / "work", backoff=0.01, retries=3, **kw)


def test_a_small_hub_file_damaged_in_transit_is_fetched_again(small_repo, tmp_path, caplog):
    src = _hub_source(small_repo, tmp_path)
    small_repo.inject("resolve", "corrupt")
    with caplog.at_level(logging.WARNING):
        assert src.read_bytes("tokenizer_config.json") == small_repo.content["tokenizer_config.json"]
    assert "does not match the hub's id" in caplog.text
    assert (tmp_path / "work" / "tokenizer_config.json").read_bytes() == small_repo.content["tokenizer_config.json"]
    small_repo.inject("resolve", "corrupt", times=2)
    src2 = _hub_source(small_repo, tmp_path / "2")
    with pytest.raises(KimiQuantError, match="do not match the hub's id twice") as ei:
        src2.read_bytes("config.json")
    assert "\n" not in str(ei.value)
    assert not (tmp_path / "2" / "work" / "config.json").exists()  # no damaged copy left to be trusted later


@pytest.mark.parametrize("value", ["inf", "1e11", "nan", "-5", "Wed, 21 Oct 2099 07:28:00 GMT", "soon"])
def test_retry_after_is_capped(value, caplog):
    from kimi_quant import hub_http

    class R:
        headers = {"Retry-After": value}

    with caplog.at_level(logging.WARNING):
        got = hub_http.retry_after(R())
    if value in ("inf", "1e11", "Wed, 21 Oct 2099 07:28:00 GMT"):
        assert got == hub_http.MAX_RETRY_AFTER and "waiting 300 s" in caplog.text
    elif value == "-5":
        assert got == 0.0
    else:
        assert got is None


@pytest.mark.parametrize("value", ["inf", "1e11"])
def test_hub_source_and_publish_survive_an_absurd_retry_after(small_repo, tmp_path, monkeypatch, caplog, value, src):
    from kimi_quant import hub_http
    from kimi_quant.publish import publish

    monkeypatch.setattr(hub_http, "MAX_RETRY_AFTER", 0.05)
    small_repo.retry_after = value
    small_repo.inject("info", "429")
    with caplog.at_level(logging.WARNING):
        assert _hub_source(small_repo, tmp_path).revision == small_repo.resolve("org/small", "main")
    assert f"Retry-After: {value}" in caplog.text
    out = tmp_path / "out"
    assert convert(src, out).returncode == 0
    small_repo.inject("create", "429")
    res = publish(out, "org/published", endpoint=small_repo.endpoint, retries=3)
    assert res.commit and small_repo.exists("org/published")


# -- 12: malformed JSON and TOML ----------------------------------------------------------------------------------------
DEEP = "[" * 100_000 + "]" * 100_000


def test_metadata_that_is_a_list_is_one_line(src):
    shard = src / "model-00001-of-00004.safetensors"
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["__metadata__"] = ["a", "b"]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw)) if len(raw) <= n else b""
    assert len(raw) == n
    shard.write_bytes(data[:8] + raw + data[8 + n:])
    r = plan(src)
    assert r.returncode == 2 and "__metadata__ must be an object of strings" in error_line(r.stderr)


@pytest.mark.parametrize("what", ["index-list", "config-deep", "index-deep", "recipe-deep", "header-deep"])
def test_malformed_files_are_one_line(src, tmp_path, what):
    extra = []
    if what == "index-list":
        (src / INDEX).write_text("[1, 2, 3]")
        want = "expected a JSON object, got a list"
    elif what == "config-deep":
        (src / "config.json").write_text(DEEP)
        want = "nested too deeply"
    elif what == "index-deep":
        (src / INDEX).write_text(DEEP)
        want = "nested too deeply"
    elif what == "recipe-deep":
        (tmp_path / "r.toml").write_text("a = " + DEEP)
        extra = ["--recipe", tmp_path / "r.toml"]
        want = "TOML nested too deeply"
    else:
        shard = src / "model-00001-of-00004.safetensors"
        raw = DEEP.encode()
        raw += b" " * (-len(raw) % 8)
        shard.write_bytes(len(raw).to_bytes(8, "little") + raw)
        want = "header is not valid JSON"
    r = plan(src, *extra)
    assert r.returncode == 2
    assert want in error_line(r.stderr)


# -- 13: malformed journal lines -------------------------------------------------------------------------------------
def test_a_malformed_journal_line_is_ignored_with_a_warning(src, tmp_path):
    out = tmp_path / "out"
    assert convert(src, out).returncode == 0
    with open(out / JOURNAL_NAME, "a") as f:
        for ev in ({"kind": "unit", "file": ["a", "b"], "size": 1, "sha256": "x"},
                   {"kind": "input", "file": {"x": 1}, "sha256": "y"},
                   {"kind": "complete", "files": ["/etc/passwd"]}, [1, 2], {"kind": "unit", "file": "x"}):
            f.write(json.dumps(ev) + "\n")
        f.write(DEEP + "\n")
    for args in (("verify", out), ("convert", src, "-t", "950dt", "-o", out, "-q")):
        r = kq(*args)
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr
        warnings = [ln for ln in r.stderr.splitlines() if "warning" in ln]
        assert len(warnings) == 6 and all("ignored" in ln for ln in warnings), r.stderr


def test_a_journal_that_is_a_link_is_refused(src, tmp_path):
    out = tmp_path / "out"
    assert convert(src, out).returncode == 0
    elsewhere = tmp_path / "elsewhere.jsonl"
    (out / JOURNAL_NAME).rename(elsewhere)
    (out / JOURNAL_NAME).symlink_to(elsewhere)
    before = elsewhere.read_bytes()
    r = convert(src, out)
    assert r.returncode == 2 and "is a symlink" in error_line(r.stderr)
    assert elsewhere.read_bytes() == before


# -- 14: hashes a huggingface_hub cache only claims ------------------------------------------------------------------
def test_a_fake_blob_sha_is_never_passed_off_as_verified(src, tmp_path):
    """A directory laid out like huggingface_hub's cache, its shards linked to blobs/<a made-up sha256>."""
    repo = tmp_path / "models--org--k3"
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    fake = {}
    for i, p in enumerate(sorted(src.iterdir())):
        if p.is_file():
            sha = f"{i:02d}" + "f" * 62
            (repo / "blobs" / sha).write_bytes(p.read_bytes())
            (snap / p.name).symlink_to(Path("..") / ".." / "blobs" / sha)
            fake[p.name] = sha
    out = tmp_path / "out"
    assert convert(snap, out).returncode == 0
    prov = json.loads((out / PROVENANCE).read_text())
    for f, rec in prov["inputs"].items():
        assert rec["sha256"] is None and rec["sha256_claimed_unverified"] == fake[f]
    r = convert(snap, tmp_path / "out2", "950dt", "--hash-inputs")
    assert r.returncode == 2
    assert "huggingface_hub's record (cache link or download metadata) claims" in error_line(r.stderr)


# -- trying to break it further ------------------------------------------------------------------------------------------
def test_an_output_folder_replaced_by_a_link_out_is_not_written_through(src, tmp_path):
    out = tmp_path / "out"
    assert convert(src, out).returncode == 0
    outside = tmp_path / "outside"
    outside.mkdir()
    import shutil

    shutil.rmtree(out / "extra")
    (out / "extra").symlink_to(outside, target_is_directory=True)
    r = convert(src, out)  # the re-run rewrites the copied files
    assert r.returncode == 2 and "outside" in error_line(r.stderr) and "refusing to write there" in r.stderr
    assert list(outside.iterdir()) == []
    r = convert(src, out, "a3", "--overwrite")  # --overwrite deletes copies, not through the link
    assert list(outside.iterdir()) == []


def test_the_lock_file_as_a_link_is_not_followed(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "target.txt"
    target.write_text("precious")
    (out / ".kimi_quant.lock").symlink_to(target)
    r = convert(src, out)
    assert r.returncode == 2
    error_line(r.stderr)
    assert target.read_text() == "precious"


def test_unsafe_names():
    from kimi_quant.untrusted import unsafe_name

    for bad in ("", "..", "../x", "a/../b", "/x", "a//b", "./a", "a/.", "a\\..\\b", "a\0b", None, ["a"]):
        assert unsafe_name(bad), bad
    for ok in ("a", "a/b.json", "x..y", ".gitattributes", "a/.hidden"):
        assert unsafe_name(ok) is None, ok


def test_a_huge_worker_count_is_refused(src, tmp_path):
    r = convert(src, tmp_path / "out", "a3", "--workers", "1000000")
    assert r.returncode == 2 and "--workers 1000000 is more than" in error_line(r.stderr)
    assert not (tmp_path / "out").exists()


def test_layer_lists_out_of_range_are_refused(src):
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["linear_attn_config"]["kda_layers"] = [1, 2, 10**12]
    (src / "config.json").write_text(json.dumps(config))
    r = plan(src)
    assert r.returncode == 2 and "kda_layers must list layer numbers 1..6" in error_line(r.stderr)


# -- the directory kimi-quant is run from is not an import path -----------------------------------------------------
@pytest.mark.parametrize("executor", ["local", "ray"])
def test_a_module_in_the_working_directory_is_never_imported(tiny_source, tmp_path, executor):
    """The local executor's fork server starts as ``python -c``, which puts the working directory first on
    its import path, and Ray puts the driver's working directory on every worker's path: a ``numba.py``
    there ran in every worker. Run as users do, through the console script (``python -m`` puts the
    working directory on the driver's own path, by the user's choice)."""
    script = Path(sys.executable).with_name("kimi-quant")
    if not script.is_file():
        pytest.skip("no kimi-quant console script beside this python (package not installed)")
    if executor == "ray":
        pytest.importorskip("ray", reason="ray is not installed")
    cwd = tmp_path / "downloads"
    cwd.mkdir()
    marker = tmp_path / "IMPORTED"
    for module in ("numba", "numpy", "multiprocessing"):
        (cwd / f"{module}.py").write_text(f"import sys; open({str(marker)!r}, 'a').write('{module}:' + repr(sys.argv) + chr(10))\n")
    r = subprocess.run([str(script), "convert", str(tiny_source), "-t", "a3", "-o", str(tmp_path / "out"), "-q",
                        "--workers", "2", "--executor", executor], cwd=cwd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert not marker.exists(), f"imported from the working directory: {marker.read_text()}"
    assert r.returncode == 0, r.stderr


# -- a source file re-pointed between the driver's check and a worker's open ------------------------------------
def test_a_file_swapped_after_vetting_is_refused_by_reader_and_hasher(src, tmp_path):
    from kimi_quant.errors import BadCheckpoint
    from kimi_quant.hashing import sha256_file
    from kimi_quant.untrusted import vetted_identity

    shard = src / "model-00001-of-00004.safetensors"
    ident = vetted_identity(shard, [src])
    with SafetensorsReader(shard, ident) as r:  # the vetted file itself is read
        assert r.tensors
    assert sha256_file(shard, identity=ident)
    decoy = tmp_path / "elsewhere" / shard.name
    decoy.parent.mkdir()
    decoy.write_bytes(shard.read_bytes())  # the same bytes: only the file's identity tells them apart
    for swap in ("link", "rename"):
        moved = tmp_path / f"moved-{swap}"
        shard.rename(moved)
        if swap == "link":
            shard.symlink_to(decoy)
        else:
            os.link(decoy, shard)
        for read in (lambda: SafetensorsReader(shard, ident), lambda: sha256_file(shard, identity=ident)):
            with pytest.raises(BadCheckpoint, match="not the file that was checked .* refusing to read it"):
                read()
        shard.unlink()
        moved.rename(shard)
    # rewritten in place (same inode, same bytes): the ctime changed
    time.sleep(0.01)
    shard.write_bytes(shard.read_bytes())
    with pytest.raises(BadCheckpoint, match="not the file that was checked"):
        SafetensorsReader(shard, ident)
    # and the driver's own check looks at the file the name opens, not at the name
    shard.rename(tmp_path / "kept")
    shard.symlink_to(decoy)
    with pytest.raises(BadCheckpoint, match=f"opens {decoy}, outside {src}"):
        vetted_identity(shard, [src])


@pytest.mark.parametrize("workers", [1, 2])
def test_a_source_shard_re_pointed_mid_run_is_never_converted(src, tmp_path, monkeypatch, workers):
    """The driver vets each source shard as it opens an output shard; a name pointed at another file
    after that (here: an outside copy with the same bytes) is refused by the worker, in one line,
    and no output shard is written from it."""
    from kimi_quant.convert import ConvertOptions, convert as convert_api
    from kimi_quant.executor import shards as sched

    decoys = tmp_path / "outside"
    decoys.mkdir()
    real = sched.OpenShard

    def open_then_swap(unit, *a, **kw):
        shard = real(unit, *a, **kw)  # the driver has vetted unit.needs
        for f in unit.needs:
            p = src / f
            if not p.is_symlink():
                (decoys / f).write_bytes(p.read_bytes())
                p.unlink()
                p.symlink_to(decoys / f)
        return shard

    monkeypatch.setattr(sched, "OpenShard", open_then_swap)
    out = tmp_path / "out"
    with pytest.raises(KimiQuantError, match="is not the file that was checked when this work was scheduled"):
        convert_api(str(src), ConvertOptions(target="a3", output=out, workers=workers, quiet=True))
    assert not list(out.glob("*.safetensors"))


@pytest.mark.parametrize("side", ["source", "quantized"])
@pytest.mark.parametrize("how", ["dotdot", "link"])
def test_validate_never_reads_a_shard_outside_the_directories_named(tmp_path, side, how):
    """validate reads both checkpoints through their indexes: an index naming ``../x`` or a shard
    that links out of its directory is refused in one line, like convert refuses it."""
    from kimi_quant.synth import synth

    src = synth("tiny", tmp_path / "src")  # the trained fixture: it ships a tokenizer, which validate needs
    out = tmp_path / "out"
    assert convert(src, out, "a3").returncode == 0
    root = src if side == "source" else out
    if side == "quantized":  # an ascendV1 folder from elsewhere: no journal, so no verify to catch it first
        (out / JOURNAL_NAME).unlink()
        (out / PROVENANCE).unlink()
    index_name = INDEX if side == "source" else "quant_model_weights.safetensors.index.json"
    index = json.loads((root / index_name).read_text())
    victim = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "outside" / victim
    outside.parent.mkdir()
    outside.write_bytes((root / victim).read_bytes())  # the same bytes, outside the directory
    if how == "dotdot":  # the index points there (the file it replaces stays, so provenance still matches)
        rel = os.path.relpath(outside, root)
        index["weight_map"] = {k: (rel if v == victim else v) for k, v in index["weight_map"].items()}
        (root / index_name).write_text(json.dumps(index))
    else:
        (root / victim).unlink()
        (root / victim).symlink_to(outside)
    r = kq("validate", str(src), str(out), "--max-tokens", "64", "--seq-len", "32")
    assert r.returncode != 0
    line = error_line(r.stderr)
    assert "outside" in line or "not a file of the checkpoint" in line or "'..' component" in line, line
    assert "Traceback" not in r.stderr


def _nonfinite_reference(arr, dtype):
    """The plain whole-array test that ``nonfinite`` must agree with."""
    bits = {"BF16": 0x7F80, "F8_E4M3": 0x7F, "F8_E5M2": 0x7C, "F8_E8M0": 0xFF}.get(dtype)
    if bits is not None:
        return bool(np.any((arr & bits) == bits))
    if dtype in ("F16", "F32", "F64"):
        return not bool(np.isfinite(arr).all())
    return False


@pytest.mark.parametrize("dtype", ["BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F16", "F32", "U8", "I8"])
def test_nonfinite_scans_in_blocks_like_the_whole_array(dtype):
    """``nonfinite`` walks big tensors in blocks (no whole-tensor temporaries): one bad element anywhere,
    first or last of a block, of any shape, is still found, and a clean tensor is still clean."""
    from kimi_quant.dtypes import STORAGE, _SCAN_BLOCK, nonfinite

    rng = np.random.default_rng(7)
    st = STORAGE[dtype]
    for size in (0, 1, 31, _SCAN_BLOCK - 1, _SCAN_BLOCK, _SCAN_BLOCK + 1, 3 * _SCAN_BLOCK + 5):
        if st.kind == "f":
            clean = rng.standard_normal(size).astype(st)
            bad_values = [np.inf, -np.inf, np.nan]
        else:
            top = np.iinfo(st).max
            clean = (rng.integers(0, top + 1, size) & 0x3F).astype(st)  # exponent field never all ones
            bad_values = [{"BF16": 0xFF80, "F8_E4M3": 0xFF, "F8_E5M2": 0x7D, "F8_E8M0": 0xFF}.get(dtype, top)]
        for arr in (clean, clean.reshape(1, -1), clean.reshape(-1, 1)):
            assert nonfinite(arr, dtype) is False
        for at in sorted({0, size // 2, _SCAN_BLOCK - 1, _SCAN_BLOCK, size - 1}):
            if not 0 <= at < size:
                continue
            for v in bad_values:
                arr = clean.copy()
                arr[at] = v
                expected = _nonfinite_reference(arr, dtype)
                assert expected == (dtype not in ("U8", "I8"))
                assert nonfinite(arr, dtype) is expected
                assert nonfinite(arr.reshape(1, -1), dtype) is expected
