"""``kimi-quant convert ORG/NAME``: a K3.1 checkpoint streamed from a real olah mirror (no network).

The hub conversion must write exactly the bytes a local conversion writes (provenance aside: source,
revision and the plan fingerprint that includes the revision), record the resolved commit and the LFS
sha256 of every input, stay within the staging window, clean up (or keep) staged shards, and resume
without downloading verified shards again. Skips when olah is not installed (scripts/install_olah.sh).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import JOURNAL_NAME, error_line, kq, snapshot  # noqa: E402
from hubtools.olah_harness import find_olah, shared_olah  # noqa: E402

pytestmark = pytest.mark.skipif(find_olah() is None,
                                reason="olah not installed (run scripts/install_olah.sh or set KIMI_QUANT_OLAH_CLI)")

PROVENANCE = "kimi_quant_provenance.json"
# Fields of the provenance that name where the source came from; everything else must be identical.
WHERE_FIELDS = ("source", "revision", "plan_fingerprint")  # the fingerprint hashes the revision
MAX_SHARD = "400KB"  # several output units from the ~3.5 MB tiny model
TARGET = "a3"


def layer_ordered(src: Path, dst: Path, n: int) -> Path:
    """Re-shard a checkpoint into ``n`` files in tensor (layer) order, as real checkpoints are.

    ``synth('tiny')`` scatters tensors over its shards by name hash, so every output unit needs every
    shard and no window smaller than the model can be honoured; layer order makes the window matter.
    """
    from kimi_quant.model.spec import spec_from_config
    from kimi_quant.source.safetensors import SafetensorsReader, read_header
    from kimi_quant.write import ShardWriter, write_json_atomic

    dst.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    order = list(spec_from_config(json.loads((src / "config.json").read_text())).expected_tensors())
    heads = {f: read_header(src / f)[0] for f in set(wm.values())}
    info = {t: heads[wm[t]][t] for t in order}
    per = sum(i.nbytes for i in info.values()) / n
    groups: list[list[str]] = [[]]
    acc = 0
    for t in order:
        if groups[-1] and acc >= per * len(groups) and len(groups) < n:
            groups.append([])
        groups[-1].append(t)
        acc += info[t].nbytes
    readers = {f: SafetensorsReader(src / f) for f in heads}
    new_wm = {}
    try:
        for i, g in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            w = ShardWriter(dst / file, [(t, info[t].dtype, info[t].shape) for t in g])
            for t in g:
                w.write(t, readers[wm[t]].array(t))
                new_wm[t] = file
            w.commit()
    finally:
        for r in readers.values():
            r.close()
    write_json_atomic(dst / "model.safetensors.index.json", {**index, "weight_map": new_wm})
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
            shutil.copy(p, dst / p.name)
    return dst


class Served:
    def __init__(self, server, local: Path, n_shards_hint: str):
        self.server = server
        self.local = local
        self.repo = server.new_repo(n_shards_hint)
        files = {p.relative_to(local).as_posix(): p for p in sorted(local.rglob("*")) if p.is_file()}
        self.sha = self.repo.commit(files, message="checkpoint")
        self.repo_id = self.repo.repo_id
        self.shards = sorted(p.name for p in local.glob("*.safetensors"))
        self.sizes = {s: (local / s).stat().st_size for s in self.shards}
        self.reference: Path | None = None  # local conversion, made once
        self.target = TARGET


@pytest.fixture(scope="module")
def olah():
    return shared_olah()


@pytest.fixture(scope="module")
def ckpts(olah, tmp_path_factory):
    from kimi_quant.synth import synth

    base = tmp_path_factory.mktemp("hubconv")
    raw = synth("tiny", base / "synth", random_weights=True)
    layered = layer_ordered(raw, base / "layered", 6)
    released = synth("tiny", base / "released", random_weights=True, experts="mxfp4")  # as Kimi K3 is published
    out = {"synth": Served(olah, raw, "synth"), "layered": Served(olah, layered, "layered"),
           "released": Served(olah, released, "released")}
    out["released"].target = "950dt"  # its experts' codes and scales, copied: the MXFP4 source's own path
    for k, s in out.items():
        s.reference = base / f"ref-{k}"
        _convert_local(s.local, s.reference, s.target)
    return out


@pytest.fixture
def hub_env(olah, monkeypatch):
    """HF_ENDPOINT at olah, HF_HUB_OFFLINE unset, for this process and its subprocesses."""
    monkeypatch.setenv("HF_ENDPOINT", olah.endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return {"HF_ENDPOINT": olah.endpoint}


def _opts(out: Path, target: str = TARGET, **kw):
    from kimi_quant.convert import ConvertOptions
    from kimi_quant.cli import parse_size

    return ConvertOptions(target=target, output=out, max_shard_size=parse_size(MAX_SHARD), quiet=True,
                          workers=kw.pop("workers", 1), **kw)


def _convert_local(src: Path, out: Path, target: str = TARGET):
    from kimi_quant.convert import convert

    return convert(str(src), _opts(out, target, hash_inputs=True))  # the sha256s a hub source lists for free


def _same_output(got: Path, ref: Path) -> dict:
    """Assert byte identity except the journal and the provenance's where-from fields; the provenance."""
    # the model card (README.md) names where the source came from, like the provenance
    a, b = (snapshot(d, skip=(JOURNAL_NAME, PROVENANCE, "README.md")) for d in (got, ref))
    assert a == b
    pg, pr = (json.loads((d / PROVENANCE).read_text()) for d in (got, ref))
    assert {k: v for k, v in pg.items() if k not in WHERE_FIELDS} == \
        {k: v for k, v in pr.items() if k not in WHERE_FIELDS}
    assert f"`{pg['source']}` @ `{pg['revision']}`" in (got / "README.md").read_text()
    return pg


def _staged(work: Path) -> list[str]:
    """Complete staged shards (downloads in progress live under .kq-hub/partial)."""
    return sorted(p.name for p in work.glob("*.safetensors"))


def _partials(work: Path) -> list[str]:
    return sorted(p.name for p in (work / ".kq-hub" / "partial").glob("*"))


def _peak_line(stdout: str) -> float:
    m = re.search(r"^peak staging disk ([\d.]+) (MB|GB)$", stdout, re.M)
    assert m, stdout
    return float(m.group(1)) * (1e6 if m.group(2) == "MB" else 1e9)


@pytest.mark.parametrize("kind,workers", [("synth", 1), ("layered", 2), ("released", 2)])
def test_hub_convert_matches_local(ckpts, hub_env, tmp_path, kind, workers):
    s = ckpts[kind]
    # the scattered synth layouts need every shard for every unit: the window must hold them all
    window = int(2.2 * max(s.sizes.values())) if kind == "layered" else sum(s.sizes.values())
    out, work = tmp_path / "out", tmp_path / "work"
    r = kq("convert", s.repo_id, "--target", s.target, "--output", out, "--work-dir", work, "--max-disk", window,
           "--max-shard-size", MAX_SHARD, "--workers", workers, env=hub_env)
    assert r.returncode == 0, r.stderr
    prov = _same_output(out, s.reference)
    assert prov["source"] == s.repo_id and prov["revision"] == s.sha
    assert {f: v["sha256"] for f, v in prov["inputs"].items()} == \
        {f: s.repo.oids[f] for f in s.shards}  # the LFS oid of each input, as listed by the hub
    assert _peak_line(r.stdout) <= window * 1.005  # printed rounded to 10 kB
    assert _staged(work) == [] and _partials(work) == []  # released shards are deleted by default


def test_keep_source_window_and_resume(ckpts, hub_env, tmp_path, monkeypatch):
    """In-process: peak within the window; a crash part-way; the rerun re-downloads no verified shard."""
    from kimi_quant.convert import convert
    from kimi_quant.source import hub as hubmod
    from kimi_quant.source.hub_stage import Stager

    s = ckpts["layered"]
    window = int(2.2 * max(s.sizes.values()))
    out, work = tmp_path / "out", tmp_path / "work"
    downloads: list[str] = []
    real_once, real_fetch = Stager.download_once, hubmod.HubSource.fetch

    def counting(self, name, size):
        downloads.append(name)
        return real_once(self, name, size)

    crash_at = {"n": 4}
    fetched: list[str] = []

    def crashing_fetch(self, name):
        if name not in fetched:
            fetched.append(name)
        if len(fetched) >= crash_at["n"]:
            raise RuntimeError("simulated crash")
        return real_fetch(self, name)

    monkeypatch.setattr(Stager, "download_once", counting)
    monkeypatch.setattr(hubmod.HubSource, "fetch", crashing_fetch)
    so = {"work_dir": work, "max_disk": window, "keep_source": True}
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert(s.repo_id, _opts(out, source_options=so))
    first = set(downloads)
    on_disk = set(_staged(work))
    assert on_disk and on_disk <= first  # verified and kept
    units_done = sum(1 for line in (out / JOURNAL_NAME).read_text().splitlines() if '"unit"' in line)

    downloads.clear()
    crash_at["n"] = 10**9
    res = convert(s.repo_id, _opts(out, source_options=so))
    assert not (set(downloads) & on_disk), (downloads, on_disk)  # verified shards are not fetched again
    assert set(downloads) | on_disk >= set(s.shards) - on_disk
    assert res.reused_units >= 1 or units_done == 0
    assert res.peak_staged_bytes is not None and 0 < res.peak_staged_bytes <= window
    _same_output(out, s.reference)
    assert _staged(work) == s.shards  # --keep-source keeps every staged shard

    # a third run: everything verified, nothing downloaded, nothing converted
    downloads.clear()
    res = convert(s.repo_id, _opts(out, source_options=so))
    assert downloads == [] and res.converted_units == 0


def test_resume_without_keep_source_reuses_staged_shards(ckpts, hub_env, tmp_path, monkeypatch):
    """Shards verified but not yet released when the run died are still on disk and are used as they are."""
    from kimi_quant.convert import convert
    from kimi_quant.source import hub as hubmod
    from kimi_quant.source.hub_stage import Stager

    s = ckpts["layered"]
    out, work = tmp_path / "out", tmp_path / "work"
    downloads: list[str] = []
    real_once, real_release = Stager.download_once, hubmod.HubSource.release
    released: list[str] = []

    def counting(self, name, size):
        downloads.append(name)
        return real_once(self, name, size)

    def crashing_release(self, name):
        real_release(self, name)
        released.append(name)
        if len(released) == 2:
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(Stager, "download_once", counting)
    monkeypatch.setattr(hubmod.HubSource, "release", crashing_release)
    so = {"work_dir": work, "max_disk": int(2.2 * max(s.sizes.values()))}
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert(s.repo_id, _opts(out, source_options=so))
    left = set(_staged(work))
    assert left, "the crash should leave staged, unreleased shards"
    assert not (left & set(released))  # released ones were deleted
    monkeypatch.setattr(hubmod.HubSource, "release", real_release)
    downloads.clear()
    res = convert(s.repo_id, _opts(out, source_options=so))
    assert not (set(downloads) & left), (downloads, left)
    assert res.reused_units >= 1
    _same_output(out, s.reference)
    assert _staged(work) == []


def test_revision_branch_is_resolved_and_recorded(olah, ckpts, hub_env, tmp_path):
    s = ckpts["synth"]
    repo = olah.new_repo("branch")  # its own repo: the others' main must not move
    files = {p.relative_to(s.local).as_posix(): p for p in sorted(s.local.rglob("*")) if p.is_file()}
    main_sha = repo.commit(files, message="checkpoint")
    dev = repo.commit({"NOTES.md": b"a dev branch commit\n"}, message="dev", branch="dev")
    assert repo.commit({"OTHER.md": b"main moves on\n"}, message="main", branch="main") not in (dev, main_sha)
    out = tmp_path / "out"
    r = kq("convert", repo.repo_id, "--target", TARGET, "--revision", "dev", "--output", out, "--work-dir",
           tmp_path / "work", "--max-shard-size", MAX_SHARD, "--workers", 1, "-q", env=hub_env)
    assert r.returncode == 0, r.stderr
    prov = json.loads((out / PROVENANCE).read_text())
    assert prov["revision"] == dev and re.fullmatch(r"[0-9a-f]{40}", dev)
    assert prov["source"] == repo.repo_id
    # README.md (the model card) names the source and its revision, like the provenance
    ref = snapshot(s.reference, skip=(JOURNAL_NAME, PROVENANCE, "README.md"))
    got = snapshot(out, skip=(JOURNAL_NAME, PROVENANCE, "README.md"))
    assert {k: v for k, v in got.items() if k in ref} == ref  # same weights (dev only adds a file)
    assert "OTHER.md" not in got  # main's later file is not in dev


def test_missing_repo_is_one_line(hub_env, tmp_path):
    r = kq("convert", "kq-test/no-such-model", "--target", TARGET, "--output", tmp_path / "out",
           "--work-dir", tmp_path / "work", env=hub_env)
    assert r.returncode != 0
    line = error_line(r.stderr)
    assert "kq-test/no-such-model" in line and "not found" in line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_no_hub_options_uses_default_work_dir(ckpts, hub_env, tmp_path, monkeypatch):
    """Without --work-dir the shards stage under $KIMI_QUANT_CACHE/hub/<org>--<name> and are cleaned up."""
    s = ckpts["synth"]
    cache = tmp_path / "cache"
    env = {**hub_env, "KIMI_QUANT_CACHE": str(cache)}
    r = kq("convert", s.repo_id, "--target", TARGET, "--output", tmp_path / "out", "--max-shard-size", MAX_SHARD,
           "--workers", 1, env=env)
    assert r.returncode == 0, r.stderr
    assert "peak staging disk" in r.stdout
    work = cache / "hub" / s.repo_id.replace("/", "--")
    assert work.is_dir() and _staged(work) == []
    _same_output(tmp_path / "out", s.reference)



@pytest.mark.parametrize("layout", ["cache", "local_dir"])
def test_hub_download_on_disk_keeps_the_hub_sha256(ckpts, hub_env, tmp_path, layout):
    """A directory the real huggingface_hub client downloaded (its cache, or a --local-dir) carries the
    hub's sha256 of each shard: the provenance keeps them without hashing, while the files are unchanged,
    but as claims (anyone can name a file blobs/<sha>); --hash-inputs checks them and then they count."""
    import os

    from huggingface_hub import snapshot_download

    s = ckpts["layered"]
    where = {"cache_dir": tmp_path / "hf-cache"} if layout == "cache" else {"local_dir": tmp_path / "download"}
    local = Path(snapshot_download(s.repo_id, revision=s.sha, endpoint=hub_env["HF_ENDPOINT"], **where))
    want = {f: s.repo.oids[f] for f in s.shards}
    r = kq("convert", local, "--target", TARGET, "--output", tmp_path / "out", "--max-shard-size", MAX_SHARD)
    assert r.returncode == 0, r.stderr
    prov = json.loads((tmp_path / "out" / PROVENANCE).read_text())
    assert {f: v["sha256_claimed_unverified"] for f, v in prov["inputs"].items()} == want
    assert {v["sha256"] for v in prov["inputs"].values()} == {None}
    r = kq("convert", local, "--target", TARGET, "--output", tmp_path / "out", "--max-shard-size", MAX_SHARD,
           "--hash-inputs")
    assert r.returncode == 0, r.stderr
    prov = json.loads((tmp_path / "out" / PROVENANCE).read_text())
    assert {f: v["sha256"] for f, v in prov["inputs"].items()} == want
    assert not any("sha256_claimed_unverified" in v for v in prov["inputs"].values())
    if layout == "local_dir":  # a file touched after its download no longer counts as the hub's
        later = (local / s.shards[0]).stat().st_mtime + 10
        os.utime(local / s.shards[0], (later, later))
        r = kq("convert", local, "--target", TARGET, "--output", tmp_path / "out2", "--max-shard-size", MAX_SHARD)
        assert r.returncode == 0, r.stderr
        prov = json.loads((tmp_path / "out2" / PROVENANCE).read_text())
        assert {f: v.get("sha256_claimed_unverified") for f, v in prov["inputs"].items()} == {**want, s.shards[0]: None}


def test_output_overlapping_the_staging_dir_is_refused(ckpts, hub_env, tmp_path):
    s = ckpts["layered"]
    work = tmp_path / "work"
    for out in (work, work / "out"):
        r = kq("convert", s.repo_id, "--target", TARGET, "--output", out, "--work-dir", work, env=hub_env)
        assert r.returncode == 2
        how = "is" if out == work else "is inside"
        assert error_line(r.stderr) == (f"kimi-quant: error: --output {out.resolve()} {how} the hub staging directory "
                                        f"(--work-dir) {work.resolve()}: choose an output directory outside it")


def test_a_window_smaller_than_one_unit_needs_is_refused_up_front(ckpts, hub_env, tmp_path):
    """--max-disk is a promise: below what one output shard needs at once it cannot be kept."""
    s = ckpts["synth"]  # scattered: every unit needs every shard
    window = max(s.sizes.values()) + 1  # holds any one shard, not all of them
    r = kq("convert", s.repo_id, "--target", TARGET, "--output", tmp_path / "out", "--work-dir", tmp_path / "w",
           "--max-disk", window, "--max-shard-size", MAX_SHARD, env=hub_env)
    assert r.returncode == 2
    line = error_line(r.stderr)
    m = re.fullmatch(rf"kimi-quant: error: --max-disk {window} bytes is less than output shard quant_model_weights-"
                     r"\d+-of-\d+\.safetensors needs at once \(its (\d+) source shards: (\d+) bytes\); raise "
                     r"--max-disk to at least that, or lower --max-shard-size", line)
    assert m and int(m.group(1)) >= 2 and int(m.group(2)) > window, line
    assert not list((tmp_path / "w").glob("*.safetensors"))  # refused before downloading anything


def test_a_moved_branch_is_refused_with_the_way_to_finish(olah, ckpts, hub_env, tmp_path):
    """main moves between two runs: the output is not mixed, and the line says how to keep it (it is finished)."""
    s = ckpts["synth"]
    repo = olah.new_repo("moving")
    files = {p.relative_to(s.local).as_posix(): p for p in sorted(s.local.rglob("*")) if p.is_file()}
    first = repo.commit(files, message="checkpoint")
    out, work = tmp_path / "out", tmp_path / "work"
    args = ("convert", repo.repo_id, "--target", TARGET, "--output", out, "--work-dir", work,
            "--max-shard-size", MAX_SHARD, "--workers", 1, "-q")
    assert kq(*args, env=hub_env).returncode == 0
    repo.commit({"NOTES.md": b"main moves on\n"}, message="later")
    r = kq(*args, env=hub_env)
    assert r.returncode == 2
    line = error_line(r.stderr)
    assert f"to keep it, pass --revision {first}; use --overwrite to replace it" in line, line
    assert kq(*args, "--revision", first, env=hub_env).returncode == 0
