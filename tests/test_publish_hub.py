"""publish() against the project's own fake hub (tests/hubtools/fake_hub.py), real huggingface_hub client."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import fresh_copy  # noqa: E402
from hubtools.fake_hub import FakeHub  # noqa: E402

from kimi_quant.errors import KimiQuantError  # noqa: E402
from kimi_quant.publish import publish  # noqa: E402

TOKEN = "hf_test_write_token"


@pytest.fixture(autouse=True)
def _no_xet(monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", True, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture
def hub(tmp_path):
    h = FakeHub(tmp_path / "hub", token=TOKEN)
    yield h
    h.close()


@pytest.fixture(scope="module")
def synth_src(tmp_path_factory) -> Path:
    from kimi_quant.synth import synth

    src = tmp_path_factory.mktemp("src")
    synth("tiny", src, random_weights=True)
    return src


def _convert(src: Path, out: Path, target: str, max_shard_size: int) -> Path:
    from kimi_quant.convert import ConvertOptions, convert

    convert(str(src), ConvertOptions(target=target, output=out, workers=1, quiet=True, max_shard_size=max_shard_size))
    return out


@pytest.fixture(scope="module")
def converted(synth_src, tmp_path_factory) -> Path:
    """A real, verified ascendV1 output from the pipeline (tiny synthetic K3.1 -> a3)."""
    out = _convert(synth_src, tmp_path_factory.mktemp("out"), "a3", 1_000_000)
    (out / "kimi_quant_validation.json").write_text(json.dumps({"perplexity": {"bf16": 9.9, "quant": 10.1}}))
    return out


@pytest.fixture(scope="module")
def converted_950dt(synth_src, tmp_path_factory) -> Path:
    """The same model for the other target, other shard names, and no validation report."""
    return _convert(synth_src, tmp_path_factory.mktemp("out950"), "950dt", 400_000)


@pytest.fixture
def output(converted, tmp_path) -> Path:
    return fresh_copy(converted, tmp_path, "output")


def _pub(hub, output, **kw):
    kw.setdefault("token", TOKEN)
    kw.setdefault("backoff", 0.01)
    return publish(output, "kq-org/tiny-a3", endpoint=hub.endpoint, **kw)


def test_publish_uploads_verified_output_with_card(hub, output):
    before = {p.name: p.read_bytes() for p in output.iterdir()}
    res = _pub(hub, output)
    remote = hub.files_at("kq-org/tiny-a3")
    shards = sorted(p.name for p in output.glob("quant_model_weights-*.safetensors"))
    for name in shards + ["quant_model_description.json", "quant_model_weights.safetensors.index.json",
                          "config.json", "kimi_quant_provenance.json", "kimi_quant_validation.json"]:
        assert remote[name] == (output / name).read_bytes(), name
    assert "kimi_quant_journal.jsonl" not in remote
    card = remote["README.md"].decode()
    assert "vllm serve" in card and "--quantization ascend" in card
    assert "sglang.launch_server" in card and "--quantization modelslim" in card and "--ep-size 16" in card
    from kimi_quant.plan import SGLANG_MOE_TP

    assert SGLANG_MOE_TP in card  # a3: int4 experts, which SGLang misreads at moe-tp > 1
    assert "a3" in card and "perplexity" in card and "kimi-k3-default" in card
    assert remote["SOURCE_README.md"] == before["SOURCE_README.md"]  # the source card kept, not overwritten
    assert before["SOURCE_README.md"].startswith(b"# Synthetic")  # convert copied it under that name
    assert "kq-org/tiny-a3" in card and "SOURCE_README.md" in card  # the card made for this repo links it
    assert {p.name: p.read_bytes() for p in output.iterdir()} == before  # output dir untouched
    assert res.uploaded and res.commit == hub.refs("kq-org/tiny-a3")["main"]
    # shards were uploaded over LFS, then ONE commit made them visible together with the small files
    from kimi_quant.publish.publish import LFS_SUFFIXES

    assert hub.count("put") == len([p for p in output.iterdir() if p.name.endswith(LFS_SUFFIXES)])  # + tiktoken.model
    assert hub.count("commit") == 1


def test_rerun_uploads_nothing(hub, output):
    _pub(hub, output)
    n_put, n_commit = hub.count("put"), hub.count("commit")
    res = _pub(hub, output)
    assert res.uploaded == [] and len(res.skipped) > 5
    assert hub.count("put") == n_put and hub.count("commit") == n_commit
    assert hub.count("batch") == 1  # only the first run asked for uploads


def test_changed_file_is_the_only_upload(hub, output):
    _pub(hub, output)
    val = output / "kimi_quant_validation.json"
    val.write_text(json.dumps({"perplexity": {"bf16": 9.9, "quant": 10.3}}))
    res = _pub(hub, output)
    assert sorted(res.uploaded) == ["README.md", "kimi_quant_validation.json"]  # the card shows validation


def test_branch_and_private(hub, output):
    res = _pub(hub, output, branch="ascend-a3", private=True)
    assert res.branch == "ascend-a3"
    refs = hub.refs("kq-org/tiny-a3")
    assert set(refs) == {"main", "ascend-a3"}
    assert "README.md" in hub.files_at("kq-org/tiny-a3", "ascend-a3")
    assert "README.md" not in hub.files_at("kq-org/tiny-a3", "main")
    assert json.loads((hub.repo_dir("kq-org/tiny-a3") / "repo.json").read_text())["private"] is True


def test_dropped_upload_is_retried(hub, output):
    hub.inject("put", "drop", times=2)
    _pub(hub, output)
    remote = hub.files_at("kq-org/tiny-a3")
    for p in output.glob("quant_model_weights-*.safetensors"):
        assert remote[p.name] == p.read_bytes()


def test_commit_500_once_is_retried(hub, output):
    hub.inject("commit", "500", times=1)
    res = _pub(hub, output)
    assert "quant_model_description.json" in hub.files_at("kq-org/tiny-a3")
    assert res.commit == hub.refs("kq-org/tiny-a3")["main"]


def test_429_with_retry_after_is_honoured(hub, output):
    hub.inject("preupload", "429", times=1)
    hub.inject("info", "429", times=1)
    _pub(hub, output)
    assert "README.md" in hub.files_at("kq-org/tiny-a3")


def test_persistent_failure_is_one_line(hub, output):
    hub.inject("commit", "500", times=50)
    with pytest.raises(KimiQuantError) as ei:
        _pub(hub, output, retries=3)
    msg = str(ei.value)
    assert "\n" not in msg and "after 3 tries" in msg and "kq-org/tiny-a3" in msg


def test_bad_token_is_one_line(hub, output):
    with pytest.raises(KimiQuantError, match="HF_TOKEN") as ei:
        _pub(hub, output, token="hf_wrong")
    assert "\n" not in str(ei.value)


REPO = "kq-org/tiny-a3"


def _expected(out: Path) -> dict[str, bytes]:
    """What the branch must hold after publishing ``out``: its upload set (bytes), .gitattributes aside."""
    from kimi_quant.publish.publish import upload_set

    return {i.path_in_repo: i.data if i.local is None else i.local.read_bytes() for i in upload_set(out, REPO, None)}


def test_republish_other_conversion_replaces_it(hub, output, converted_950dt, tmp_path):
    from huggingface_hub import CommitOperationAdd, HfApi

    _pub(hub, output)
    a3 = set(hub.files_at(REPO))
    # a hand-edited .gitattributes: publish never deletes or rewrites it
    attrs = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.tiktoken filter=lfs diff=lfs merge=lfs -text\n"
    HfApi(endpoint=hub.endpoint, token=TOKEN).create_commit(REPO, [CommitOperationAdd(".gitattributes", attrs)],
                                                            commit_message="attrs")
    before = hub.refs(REPO)["main"]
    new = fresh_copy(converted_950dt, tmp_path, "out950")
    res = _pub(hub, new)
    remote, expected = hub.files_at(REPO), _expected(new)
    assert remote.pop(".gitattributes") == attrs
    assert set(remote) == set(expected)  # nothing of the a3 conversion is left
    for name, data in expected.items():
        if name != "README.md":  # the published card has the verify summary, this one not: see below
            assert remote[name] == data, name
    stale = a3 - set(expected) - {".gitattributes"}
    assert any(p.startswith("quant_model_weights-") for p in stale) and "kimi_quant_validation.json" in stale
    assert sorted(res.deleted) == sorted(stale)
    assert "Not validated" in remote["README.md"].decode() and "950dt" in remote["README.md"].decode()
    # the switch is one commit: no state in the branch's history mixes the two conversions
    assert json.loads((hub.repo_dir(REPO) / "commits" / f"{res.commit}.json").read_text())["parent"] == before


def test_interrupted_publish_leaves_previous_state(hub, output, converted_950dt, tmp_path):
    _pub(hub, output)
    before = hub.files_at(REPO)
    new = fresh_copy(converted_950dt, tmp_path, "out950")
    shards = sorted(new.glob("quant_model_weights-*.safetensors"))
    hub.inject("commit", "500", times=2)  # every LFS upload succeeds, the commit never does
    with pytest.raises(KimiQuantError, match="after 2 tries"):
        _pub(hub, new, retries=2)
    for p in shards:  # the shards did reach the hub's LFS store ...
        assert hub.obj_path(hashlib.sha256(p.read_bytes()).hexdigest()).exists()
    assert hub.files_at(REPO) == before  # ... but the branch is exactly the a3 conversion still, no mix
    n_put = hub.count("put")
    res = _pub(hub, new)  # the re-run sends no shard again and switches in one commit
    assert hub.count("put") == n_put
    assert set(hub.files_at(REPO)) - {".gitattributes"} == set(_expected(new))
    assert res.deleted and res.uploaded


def test_fake_hub_deletes_folders(hub):
    """The fake speaks the real commit protocol's deletedFolder too (CommitOperationDelete of a folder)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.create_repo("kq-org/f")
    api.create_commit("kq-org/f", [CommitOperationAdd("d/a.txt", b"a"), CommitOperationAdd("d/e/b.txt", b"b"),
                                   CommitOperationAdd("c.txt", b"c")], commit_message="add")
    api.create_commit("kq-org/f", [CommitOperationDelete("d/")], commit_message="rm")
    assert set(hub.files_at("kq-org/f")) == {".gitattributes", "c.txt"}


def test_refuses_incomplete_output(hub, output):
    shard = sorted(output.glob("quant_model_weights-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(KimiQuantError, match="refusing to publish") as ei:
        _pub(hub, output)
    assert shard.name in str(ei.value)
    assert not hub.exists("kq-org/tiny-a3")


def test_refuses_output_failing_verification(hub, output):
    shard = sorted(output.glob("quant_model_weights-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(KimiQuantError, match="refusing to publish"):
        _pub(hub, output)
    assert not hub.exists("kq-org/tiny-a3")


def test_refuses_non_output(hub, tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(KimiQuantError, match="quant_model_description.json"):
        _pub(hub, tmp_path / "x")


def test_cli_command(hub, output, converted_950dt, monkeypatch):
    from click.testing import CliRunner

    from kimi_quant.publish.command import publish as cmd

    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    r = CliRunner().invoke(cmd, [str(output), "--repo-id", "kq-org/cli-test"])
    assert r.exit_code == 0, r.output
    assert "published" in r.output
    r = CliRunner().invoke(cmd, [str(output), "--repo-id", "kq-org/cli-test"])
    assert r.exit_code == 0 and "nothing to upload" in r.output
    r = CliRunner().invoke(cmd, [str(converted_950dt), "--repo-id", "kq-org/cli-test"])
    assert r.exit_code == 0 and "file(s) not in this output" in r.output, r.output


# -- the hub source against the fake hub: Range resume and faults olah cannot produce ------------------
def _hub_repo(hub, files: dict[str, bytes]) -> str:
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.create_repo("kq-org/src", exist_ok=True)
    api.create_commit("kq-org/src", [CommitOperationAdd(k, v) for k, v in files.items()], commit_message="src")
    return "kq-org/src"


@pytest.fixture
def src_repo(hub):
    from hubtools.checkpoints import make_shards

    files = make_shards(2, rows=256, cols=512)
    return _hub_repo(hub, files), files


def _src(hub, repo, tmp_path, **kw):
    from kimi_quant.source.hub import HubSource

    return HubSource(repo, endpoint=hub.endpoint, work_dir=tmp_path / "w", backoff=0.01, token=TOKEN, **kw)


def test_source_resumes_dropped_download_with_range(hub, src_repo, tmp_path):
    repo, files = src_repo
    name = "model-00001-of-00002.safetensors"
    src = _src(hub, repo, tmp_path)
    assert src.entry(name).sha256 == hashlib.sha256(files[name]).hexdigest()
    hub.inject("resolve", "drop", times=1)
    assert src.fetch(name).read_bytes() == files[name]
    # the second GET asked for the rest only: transferred bytes == file size (+0 re-sent)
    assert src.downloaded_bytes == len(files[name])


def test_source_header_uses_range(hub, src_repo, tmp_path):
    repo, files = src_repo
    src = _src(hub, repo, tmp_path)
    h = src.header("model-00002-of-00002.safetensors")
    assert len(h) == 3 and src.downloaded_bytes == 0


def test_source_429_and_500_retried(hub, src_repo, tmp_path):
    repo, files = src_repo
    name = "model-00002-of-00002.safetensors"
    src = _src(hub, repo, tmp_path)
    hub.inject("resolve", "429", times=1)
    hub.inject("resolve", "500", times=1)
    assert src.fetch(name).read_bytes() == files[name]


def test_source_404s(hub, src_repo, tmp_path):
    from kimi_quant.source.hub import HubSource

    repo, files = src_repo
    with pytest.raises(KimiQuantError, match="revision 'nope' not found"):
        _src(hub, repo, tmp_path, revision="nope")
    with pytest.raises(KimiQuantError, match="repo not found"):
        HubSource("kq-org/missing", endpoint=hub.endpoint, work_dir=tmp_path, retries=1)
    src = _src(hub, repo, tmp_path)
    src.files()
    from kimi_quant.source.base import FileEntry

    src._files["gone.safetensors"] = FileEntry("gone.safetensors", 10, "0" * 64)
    with pytest.raises(KimiQuantError, match=r"gone.safetensors: not found on the hub \(HTTP 404\)"):
        src.fetch("gone.safetensors")


def test_source_private_repo_needs_token(hub, tmp_path, output):
    _pub(hub, output, private=True)
    from kimi_quant.source.hub import HubSource

    with pytest.raises(KimiQuantError, match="HF_TOKEN") as ei:
        HubSource("kq-org/tiny-a3", endpoint=hub.endpoint, work_dir=tmp_path, token="hf_wrong", retries=1)
    assert "\n" not in str(ei.value)
    ok = HubSource("kq-org/tiny-a3", endpoint=hub.endpoint, work_dir=tmp_path, token=TOKEN)
    assert "README.md" in {f.name for f in ok.files()}


def test_source_disk_full_is_one_line(hub, src_repo, tmp_path, monkeypatch):
    import errno

    from kimi_quant.source.hub_stage import Stager

    repo, files = src_repo
    src = _src(hub, repo, tmp_path)
    real_open = Stager.open_partial

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, k):
            return getattr(self.f, k)

    def fake_open(self, path, mode):
        f = real_open(self, path, mode)
        return Full(f) if mode in ("wb", "r+b") else f

    monkeypatch.setattr(Stager, "open_partial", fake_open)
    with pytest.raises(KimiQuantError, match="disk full") as ei:
        src.fetch("model-00001-of-00002.safetensors")
    assert "\n" not in str(ei.value)
