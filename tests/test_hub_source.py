"""HubSource against a real olah mirror serving hand-made git repos (no network).

Skips when olah is not installed (scripts/install_olah.sh installs it into its own venv).
"""

from __future__ import annotations

import hashlib
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hubtools.checkpoints import make_shards  # noqa: E402
from hubtools.olah_harness import find_olah, shared_olah  # noqa: E402

from kimi_quant.errors import BadCheckpoint, KimiQuantError  # noqa: E402
from kimi_quant.source.safetensors import read_header  # noqa: E402

pytestmark = pytest.mark.skipif(find_olah() is None,
                                reason="olah not installed (run scripts/install_olah.sh or set KIMI_QUANT_OLAH_CLI)")


@pytest.fixture(scope="session")
def olah():
    return shared_olah()


@pytest.fixture
def repo(olah):
    r = olah.new_repo()
    files = make_shards(3)
    r.files = files
    r.sha = r.commit(files, message="v1", tag="v1.0")
    return r


def open_hub(olah, repo, tmp_path, **kw):
    from kimi_quant.source.hub import HubSource

    kw.setdefault("work_dir", tmp_path / "work")
    kw.setdefault("backoff", 0.01)
    kw.setdefault("retries", 2)
    return HubSource(repo.repo_id, endpoint=olah.endpoint, **kw)


SHARDS = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]


def test_revision_resolution(olah, repo, tmp_path):
    second = repo.commit({"extra.txt": b"x"}, message="v2")
    assert open_hub(olah, repo, tmp_path).revision == second  # default: main
    assert open_hub(olah, repo, tmp_path, revision="main").revision == second
    assert open_hub(olah, repo, tmp_path, revision="v1.0").revision == repo.sha  # tag
    assert open_hub(olah, repo, tmp_path, revision=repo.sha).revision == repo.sha  # sha
    with pytest.raises(KimiQuantError, match="revision 'nope' not found"):
        open_hub(olah, repo, tmp_path, revision="nope")


def test_open_source_dispatches_to_hub(olah, repo, tmp_path, monkeypatch):
    from kimi_quant.source import open_source
    from kimi_quant.source.hub import HubSource

    monkeypatch.setenv("HF_ENDPOINT", olah.endpoint)
    src = open_source(repo.repo_id, revision="v1.0", work_dir=tmp_path / "w")
    assert isinstance(src, HubSource) and src.revision == repo.sha


def test_missing_repo_is_one_line(olah, tmp_path):
    from kimi_quant.source.hub import HubSource

    with pytest.raises(KimiQuantError, match="repo not found") as ei:
        HubSource("kq-test/does-not-exist", endpoint=olah.endpoint, work_dir=tmp_path, retries=1)
    assert "\n" not in str(ei.value)


def test_files_listing_with_sha256(olah, repo, tmp_path):
    src = open_hub(olah, repo, tmp_path)
    got = {f.name: f for f in src.files()}
    assert set(got) == set(repo.files)
    for name, data in repo.files.items():
        assert got[name].size == len(data)
        if name.endswith(".safetensors"):
            assert got[name].sha256 == hashlib.sha256(data).hexdigest()
        else:
            assert got[name].sha256 is None


def test_read_bytes_and_weight_map(olah, repo, tmp_path):
    src = open_hub(olah, repo, tmp_path)
    assert src.read_bytes("config.json") == repo.files["config.json"]
    wm = src.weight_map()
    assert set(wm.values()) == set(SHARDS)
    with pytest.raises(BadCheckpoint, match="not in the repo"):
        src.read_bytes("nope.json")


def test_header_without_download(olah, repo, tmp_path):
    src = open_hub(olah, repo, tmp_path)
    for name in SHARDS:
        local = tmp_path / ("ref-" + name)
        local.write_bytes(repo.files[name])
        assert src.header(name) == {k: v for k, v in read_header(local)[0].items()}
        assert not (src.work_dir / name).exists()  # nothing staged
    assert src.downloaded_bytes == 0


def test_bad_header_named(olah, tmp_path):
    r = olah.new_repo("bad")
    r.commit({"model.safetensors": b"\xff" * 8 + b"garbage" * 20, "config.json": b"{}"})
    from kimi_quant.source.hub import HubSource

    src = HubSource(r.repo_id, endpoint=olah.endpoint, work_dir=tmp_path)
    with pytest.raises(BadCheckpoint, match=r"kq-test/bad-\d+@[0-9a-f]{12}/model.safetensors: header length"):
        src.header("model.safetensors")


def test_fetch_verifies_and_release_deletes(olah, repo, tmp_path):
    src = open_hub(olah, repo, tmp_path)
    p = src.fetch(SHARDS[0])
    assert p.read_bytes() == repo.files[SHARDS[0]]
    assert src.header(SHARDS[0])  # now read locally
    src.release(SHARDS[0])
    assert not p.exists()
    assert src.staged_bytes == 0


def test_keep_source_keeps(olah, repo, tmp_path):
    src = open_hub(olah, repo, tmp_path, keep_source=True)
    p = src.fetch(SHARDS[1])
    src.release(SHARDS[1])
    assert p.exists()


def test_corrupt_object_one_clear_error(olah, repo, tmp_path):
    repo.corrupt(SHARDS[1])
    src = open_hub(olah, repo, tmp_path)
    with pytest.raises(KimiQuantError) as ei:
        src.fetch(SHARDS[1])
    msg = str(ei.value)
    assert "\n" not in msg and SHARDS[1] in msg and "checksum" in msg
    assert not (src.work_dir / SHARDS[1]).exists()


def test_corrupt_object_through_prefetch(olah, repo, tmp_path):
    repo.corrupt(SHARDS[0])
    src = open_hub(olah, repo, tmp_path)
    src.prefetch(SHARDS)
    try:
        with pytest.raises(KimiQuantError, match="checksum"):
            src.fetch(SHARDS[0])
        assert src.fetch(SHARDS[1]).read_bytes() == repo.files[SHARDS[1]]
    finally:
        src.close()


def test_prefetch_bounded_staging(olah, tmp_path):
    r = olah.new_repo("many")
    files = make_shards(8, rows=128, cols=256)
    r.commit(files)
    names = [n for n in sorted(files) if n.endswith(".safetensors")]
    size = len(files[names[0]])
    window = 2 * size + size // 2  # two shards fit, a third does not
    from kimi_quant.source.hub import HubSource

    src = HubSource(r.repo_id, endpoint=olah.endpoint, work_dir=tmp_path, max_disk=window, workers=3)
    seen_on_disk = []
    src.prefetch(names)
    try:
        for n in names:
            p = src.fetch(n)
            assert p.read_bytes() == files[n]
            staged = [q for q in names if (tmp_path / q).exists()]
            seen_on_disk.append(len(staged))
            src.release(n)
    finally:
        src.close()
    assert src.peak_staged_bytes <= window
    assert src.peak_staged_bytes >= 2 * size  # it did download ahead
    assert max(seen_on_disk) <= 2
    assert not any((tmp_path / n).exists() for n in names)


def test_prefetch_lookahead_count(olah, repo, tmp_path):
    src = open_hub(olah, repo, tmp_path, lookahead=1, workers=2)
    src.prefetch(SHARDS)
    try:
        for n in SHARDS:
            assert src.fetch(n).read_bytes() == repo.files[n]
            src.release(n)
    finally:
        src.close()
    assert src.peak_staged_bytes == max(len(repo.files[n]) for n in SHARDS)


def test_shard_larger_than_window_refused(olah, repo, tmp_path):
    src = open_hub(olah, repo, tmp_path, max_disk=100)
    with pytest.raises(KimiQuantError, match="larger than --max-disk"):
        src.prefetch(SHARDS)


def test_resume_skips_verified_shards(olah, repo, tmp_path):
    src = open_hub(olah, repo, tmp_path, keep_source=True)
    for n in SHARDS[:2]:
        src.fetch(n)
    first = src.downloaded_bytes
    assert first == sum(len(repo.files[n]) for n in SHARDS[:2])
    src.close()  # the first run ends
    again = open_hub(olah, repo, tmp_path, keep_source=True)
    again.prefetch(SHARDS)
    try:
        for n in SHARDS:
            assert again.fetch(n).read_bytes() == repo.files[n]
            again.release(n)
    finally:
        again.close()
    assert again.downloaded_bytes == len(repo.files[SHARDS[2]])


def test_a_marked_file_damaged_with_its_mtime_restored_is_downloaded_again(olah, repo, tmp_path):
    """The marker of an earlier run spares the download, not the check: a staged shard changed in
    place (a disk error; an edit that restores the mtime) is re-hashed before use and fetched again."""
    import os

    src = open_hub(olah, repo, tmp_path, keep_source=True)
    path = src.fetch(SHARDS[0])
    st = path.stat()
    bad = bytearray(path.read_bytes())
    bad[-1] ^= 1
    path.write_bytes(bytes(bad))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the marker's size and mtime still match
    src.close()
    again = open_hub(olah, repo, tmp_path, keep_source=True)
    assert again.header(SHARDS[0])  # planning trusts the marker (the header bytes are not the damage)
    assert again.fetch(SHARDS[0]).read_bytes() == repo.files[SHARDS[0]]
    assert again.downloaded_bytes == len(repo.files[SHARDS[0]])
    again.close()
    third = open_hub(olah, repo, tmp_path, keep_source=True)  # right bytes now: hashed, not downloaded
    assert third.fetch(SHARDS[0]).read_bytes() == repo.files[SHARDS[0]] and third.downloaded_bytes == 0


def test_resume_hashes_unmarked_file_and_replaces_bad_one(olah, repo, tmp_path):
    src = open_hub(olah, repo, tmp_path)
    work = src.work_dir
    work.mkdir(parents=True, exist_ok=True)
    (work / SHARDS[0]).write_bytes(repo.files[SHARDS[0]])  # right bytes, no marker: hashed, kept
    bad = bytearray(repo.files[SHARDS[1]])
    bad[-1] ^= 1
    (work / SHARDS[1]).write_bytes(bytes(bad))  # wrong bytes, same size: downloaded again
    assert src.fetch(SHARDS[0]).read_bytes() == repo.files[SHARDS[0]]
    assert src.downloaded_bytes == 0
    assert src.fetch(SHARDS[1]).read_bytes() == repo.files[SHARDS[1]]
    assert src.downloaded_bytes == len(repo.files[SHARDS[1]])


def test_partial_download_completed(olah, repo, tmp_path):
    """olah ignores Range: a partial file is restarted from zero and still verifies."""
    src = open_hub(olah, repo, tmp_path)
    part = src.stager.partial(SHARDS[2])
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes(repo.files[SHARDS[2]][:1000])
    assert src.fetch(SHARDS[2]).read_bytes() == repo.files[SHARDS[2]]
    assert not part.exists()


def test_fetch_missing_file_404(olah, repo, tmp_path):
    src = open_hub(olah, repo, tmp_path)
    with pytest.raises(BadCheckpoint, match="not in the repo"):
        src.fetch("model-00009-of-00009.safetensors")
    src._files["ghost.safetensors"] = type(src._files[SHARDS[0]])("ghost.safetensors", 10, "0" * 64)
    # olah answers a file missing from the tree with HTTP 500 (real hubs: 404, tested on fake_hub)
    with pytest.raises(KimiQuantError, match="ghost.safetensors") as ei:
        src.fetch("ghost.safetensors")
    assert "\n" not in str(ei.value)


def test_close_stops_workers(olah, repo, tmp_path):
    src = open_hub(olah, repo, tmp_path, lookahead=1)
    src.prefetch(SHARDS)
    src.close()
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("kq-hub-")
                   and t in src.stager.threads)


def test_two_runs_cannot_stage_into_one_work_dir(olah, repo, tmp_path):
    first = open_hub(olah, repo, tmp_path)
    second = open_hub(olah, repo, tmp_path)  # same work dir
    try:
        first.prefetch(SHARDS)
        with pytest.raises(KimiQuantError, match=r"is staging shards for another kimi-quant run \(pid \d+\); wait for "
                                                 r"it to end, or give this run its own --work-dir"):
            second.fetch(SHARDS[0])
    finally:
        first.close()
    try:  # released at the end of the first run
        assert second.fetch(SHARDS[0]).read_bytes() == repo.files[SHARDS[0]]
    finally:
        second.close()
