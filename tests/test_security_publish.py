"""Issue 31, class 2: ``publish`` uploads what kimi-quant wrote and nothing else, private unless --public;
``convert`` never copies native code or pickles out of a source. Through the real CLI against the
project's fake hub (real HTTP, the real huggingface_hub client)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import error_line, kq, make_checkpoint  # noqa: E402
from hubtools.fake_hub import FakeHub  # noqa: E402

PLANTED = {"id_rsa": b"-----BEGIN OPENSSH PRIVATE KEY-----\n", "secrets/credentials": b"[default]\nkey=x\n",
           "notes.txt": b"my notes\n", "core": b"\0" * 300_000, ".env": b"HF_TOKEN=hf_x\n"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    src = make_checkpoint(tmp_path_factory.mktemp("pub") / "src")
    (src / "libevil.so").write_bytes(b"\x7fELF" + b"\0" * 100)
    (src / "extra" / "state.pkl").write_bytes(b"\x80\x04N.")
    (src / "tokenizer_config.json").write_text('{"model_max_length": 8}\n')
    out = src.parent / "out"
    r = kq("convert", src, "-t", "a3", "-o", out, "-q")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", True, raising=False)
    h = FakeHub(tmp_path / "hub")
    yield h
    h.close()


def _publish(hub, out, repo, *extra):
    return kq("publish", out, "--repo-id", repo, *extra,
              env={"HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"})


def test_convert_copies_no_native_code_or_pickle(converted):
    assert (converted / "tokenizer_config.json").is_file() and (converted / "extra" / "notes.txt").is_file()
    assert not (converted / "libevil.so").exists() and not (converted / "extra" / "state.pkl").exists()


def test_publish_uploads_only_what_kimi_quant_wrote_and_names_the_rest(converted, hub, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    before = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    for rel, data in PLANTED.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    r = _publish(hub, out, "me/model")
    assert r.returncode == 0, r.stderr
    remote = hub.files_at("me/model")
    assert not set(PLANTED) & set(remote), sorted(remote)
    expected = before - {"kimi_quant_journal.jsonl", ".kimi_quant.lock"}
    assert set(remote) - {".gitattributes"} == expected | {"README.md"}
    left = [ln for ln in r.stderr.splitlines() if ln.startswith("leaving out")]
    assert len(left) == 1 and all(name in left[0] for name in PLANTED), r.stderr
    assert "--include" in left[0]
    assert any(ln.startswith("me/model: private repo") for ln in r.stderr.splitlines()), r.stderr
    assert json.loads((hub.repo_dir("me/model") / "repo.json").read_text())["private"] is True
    # on purpose: --include names a file, --public makes the new repo public
    r = _publish(hub, out, "me/public", "--include", "notes.txt", "--public")
    assert r.returncode == 0, r.stderr
    remote = hub.files_at("me/public")
    assert remote["notes.txt"] == PLANTED["notes.txt"] and "id_rsa" not in remote and ".env" not in remote
    assert any(ln.startswith("me/public: public repo") for ln in r.stderr.splitlines()), r.stderr
    assert json.loads((hub.repo_dir("me/public") / "repo.json").read_text())["private"] is False


def test_publish_refuses_a_leftover_calibration_state(converted, hub, tmp_path):
    """Killed between the journal's "complete" line and the state file's removal: the state (activations
    of possibly private calibration text) must never be published, and verify says how to finish."""
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    (out / "kimi_quant_calib_state.safetensors").write_bytes(b"\0" * 64)
    v = kq("verify", out)
    line = error_line(v.stderr)
    assert v.returncode == 2 and "kimi_quant_calib_state.safetensors" in line and "kimi-quant convert" in line, line
    r = _publish(hub, out, "me/state")
    assert r.returncode == 2 and "refusing to publish" in error_line(r.stderr)
    assert not hub.exists("me/state")
    os.unlink(out / "kimi_quant_calib_state.safetensors")
    assert kq("verify", out).returncode == 0
