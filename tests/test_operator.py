"""The operator's view of a job: ``plan`` sizes it, a re-run names what changed, a failed validation
gates verify and publish, progress numbers that do not mislead, and the CLI's conventions."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import JOURNAL_NAME, default_sigint, error_line, kq, target_args

PROVENANCE = "kimi_quant_provenance.json"
VALIDATION = "kimi_quant_validation.json"


@pytest.fixture
def cache_env(tmp_path):
    """A private kimi-quant cache (codec rates, staging) for the subprocesses."""
    return {"KIMI_QUANT_CACHE": str(tmp_path / "kq-cache")}


# -- 1. plan sizes the job ----------------------------------------------------------------------------
def _numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"(\d+(?:\.\d+)?) (?:GB|MB)", line)]


def test_plan_sizes_the_job_first(tiny_source, tmp_path, cache_env):
    r = kq("plan", tiny_source, "-t", "950dt", "--workers", "3", "--json", tmp_path / "p.json", env=cache_env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    heads = [ln.split()[0] for ln in lines[:7]]
    assert heads == ["plan", "output", "disk", "memory", "time", "quant", "(-v:"], r.stdout
    totals = json.loads((tmp_path / "p.json").read_text())["totals"]
    # the printed numbers are the JSON totals
    assert totals["disk_staging_bytes"] is None and totals["disk_needed_bytes"] == totals["out_bytes"]
    assert "local source is read in place" in lines[2] and "staging" not in r.stdout
    assert totals["workers"] == 3 and "3 workers" in lines[3]
    assert totals["memory_peak_bytes"] == 300 * 1024**2 + 3 * totals["memory_per_worker_bytes"]
    assert totals["wall_seconds"] > 0 and totals["core_seconds"] > 0
    assert set(totals["rates"]["per_byte"]) >= {"FLOAT", "W4A8_MXFP", "W8A8_MXFP8", "W4A8_DYNAMIC", "W8A8_DYNAMIC"}
    assert totals["model_quant_type"] == "W4A8_MXFP"
    assert "model_quant_type W4A8_MXFP: the highest type present" in lines[5]
    assert sum(s["out_bytes"] for s in totals["schemes"].values()) == totals["out_bytes"]
    assert "quant_model_weights-00001" not in r.stdout  # the shard list only on request
    # the rates were stored and are reused
    assert (tmp_path / "kq-cache" / "codec_rates.json").is_file()
    again = kq("plan", tiny_source, "-t", "950dt", "--workers", "3", "--json", tmp_path / "q.json", env=cache_env)
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "q.json").read_text())["totals"]["rates"]["from"].endswith("codec_rates.json")


def test_plan_shards_on_request(tiny_source, cache_env):
    for flag in ("-v", "--shards"):
        r = kq("plan", tiny_source, "-t", "a3", "--max-shard-size", "1MB", flag, env=cache_env)
        assert r.returncode == 0, r.stderr
        shards = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("quant_model_weights-")]
        n = int(re.search(r"(\d+) output shards", r.stdout).group(1))
        assert n > 1 and len(shards) == n, r.stdout
        assert "W4A8_DYNAMIC" in r.stdout  # the scheme table


def test_plan_time_scales_with_workers(tmp_path, cache_env):
    """More workers, less wall time at any shard count (shards are split into parts); Ray workers beyond
    the cores count; with a download link given, a hub source is never faster than its download."""
    from kimi_quant.estimate import STARTUP_S, Rates, size_job
    from kimi_quant.plan import Plan, TensorPlan, UnitPlan

    units = [UnitPlan(f"u{i}", [TensorPlan(f"t{i}", f"s{i}", "BF16", [1024, 1024], "W4A8_MXFP", None,
                                           [[f"t{i}", "U8", [1024, 512]]])]) for i in range(8)]
    p = Plan("src", None, "950dt", 32, {"name": "r"}, 1 << 30, {f"s{i}": 2 << 20 for i in range(8)}, units)
    rates = Rates({"W4A8_MXFP": 1e-7, "FLOAT": 1e-9}, "cpu", "v", "now")
    one = size_job(p, rates, workers=1, executor="ray")
    eight = size_job(p, rates, workers=8, executor="ray")
    many = size_job(p, rates, workers=64, executor="ray")
    assert one["core_seconds"] == pytest.approx(8 * 2 * 1024 * 1024 * 1e-7, rel=1e-3)
    assert eight["wall_seconds"] - STARTUP_S == pytest.approx((one["wall_seconds"] - STARTUP_S) / 8, rel=1e-2)
    assert many["wall_seconds"] == eight["wall_seconds"]  # 8 tensors: at most 8 workers have work
    # the same 8 tensors in one output shard: its parts run on every worker
    p1 = Plan("src", None, "950dt", 32, {"name": "r"}, 1 << 30, p.inputs, [UnitPlan("u", [t for u in units for t in u.tensors])])
    assert size_job(p1, rates, workers=8, executor="ray")["wall_seconds"] == eight["wall_seconds"]
    assert size_job(p1, rates, workers=8, executor="ray")["limit"] == "cpu"
    # a hub source over a link: the longer of converting and downloading
    slow = size_job(p, rates, workers=8, executor="ray", hub=True, link_bps=1e6)
    assert slow["limit"] == "download" and slow["wall_seconds"] == pytest.approx(STARTUP_S + 16 * 2**20 / 1e6, abs=1e-3)
    fast = size_job(p, rates, workers=8, executor="ray", hub=True, link_bps=1e12)
    assert fast["limit"] == "cpu" and fast["wall_seconds"] == eight["wall_seconds"]
    hub = size_job(p, rates, workers=2, hub=True, max_disk=5 << 21)
    assert hub["disk_staging_bytes"] == 5 << 21 and hub["disk_needed_bytes"] == p.out_bytes + (5 << 21)
    assert hub["min_max_disk_bytes"] == 2 << 20 and not hub["max_disk_too_small"]
    assert size_job(p, rates, workers=2, hub=True, max_disk=1 << 20)["max_disk_too_small"]


def test_plan_estimate_within_reach_of_a_measured_convert(mid_source, tmp_path, cache_env):
    """The plan's core-seconds are the same order as a real conversion's (a loaded CI box: a wide band)."""
    import os
    import resource

    r = kq("plan", mid_source, *target_args("a3"), "--workers", "1", "--json", tmp_path / "p.json", env=cache_env)
    assert r.returncode == 0, r.stderr
    est = json.loads((tmp_path / "p.json").read_text())["totals"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    c = kq("convert", mid_source, *target_args("a3"), "--workers", "1", "-o", tmp_path / "out", "-q", env=cache_env)
    assert c.returncode == 0, c.stderr
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert used / 20 < est["wall_seconds"] < used * 20, (est["wall_seconds"], used, os.cpu_count())


def test_plan_local_source_ignores_staging_options(tiny_source, cache_env, tmp_path):
    r = kq("plan", tiny_source, "-t", "a3", "--max-disk", "1GB", "--work-dir", tmp_path / "w", env=cache_env)
    assert r.returncode == 0, r.stderr
    assert "warning: --work-dir, --max-disk ignored" in r.stderr and "local directory" in r.stderr
    assert not (tmp_path / "w").exists()
    line = error_line(kq("plan", tiny_source, "-t", "a3", "--revision", "v1", env=cache_env).stderr)
    assert "--revision v1" in line and "local directory" in line


def test_plan_hub_source_staging_window(tiny_source, tmp_path, cache_env):
    """A hub source: disk = output + staging window for --max-disk, and the minimum window."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hubtools.olah_harness import find_olah, shared_olah

    if find_olah() is None:
        pytest.skip("olah not installed (run scripts/install_olah.sh or set KIMI_QUANT_OLAH_CLI)")
    server = shared_olah()
    repo = server.new_repo("plansize")
    repo.commit({p.relative_to(tiny_source).as_posix(): p for p in sorted(Path(tiny_source).rglob("*"))
                 if p.is_file()}, message="ckpt")
    env = {**cache_env, "HF_ENDPOINT": server.endpoint, "HF_HUB_OFFLINE": "0"}
    r = kq("plan", repo.repo_id, "-t", "a3", "--max-disk", "50MB", "--work-dir", tmp_path / "stage",
           "--json", tmp_path / "p.json", env=env)
    assert r.returncode == 0, r.stderr
    totals = json.loads((tmp_path / "p.json").read_text())["totals"]
    size = sum(p.stat().st_size for p in Path(tiny_source).glob("*.safetensors"))
    assert totals["disk_staging_bytes"] == size  # the window is capped at the whole source
    assert totals["disk_needed_bytes"] == totals["out_bytes"] + size
    assert totals["download_bytes"] == size
    disk = [ln for ln in r.stdout.splitlines() if ln.startswith("disk")][0]
    assert "staging window" in disk and str(tmp_path / "stage") in disk
    assert "downloading" in r.stdout
    small = kq("plan", repo.repo_id, "-t", "a3", "--max-disk", "100KB", "--work-dir", tmp_path / "stage", env=env)
    assert "convert would refuse it" in small.stdout, small.stdout + small.stderr


# -- 2. a re-run that differs names the options and the command that finishes the output -------------
def test_rerun_with_a_left_out_option_names_it(tiny_source, tmp_path):
    out = tmp_path / "out"
    first = kq("convert", tiny_source, *target_args("a3"), "--max-shard-size", "1MB", "--override",
               "*.layers.3.*=FLOAT", "-o", out, "-q")
    assert first.returncode == 0, first.stderr
    before = sorted(p.name for p in out.iterdir())
    r = kq("convert", tiny_source, *target_args("a3"), "-o", out, "-q")
    line = error_line(r.stderr)
    assert "--max-shard-size was 1MB, now 4GiB" in line
    assert "--override was '*.layers.3.*=FLOAT', now not given" in line
    n_shards = len(list(out.glob("quant_model_weights-*.safetensors")))
    assert f"discarding its {n_shards} finished shards" in line
    cmd = line.split("the command that made it: ")[1]  # a finished output: nothing to finish
    assert sorted(p.name for p in out.iterdir()) == before  # nothing touched
    import shlex

    args = shlex.split(cmd)
    assert args[:2] == ["kimi-quant", "convert"] and "--max-shard-size" in args and "--override" in args
    again = kq(*args[1:], "-q")  # the printed command finishes (here: re-verifies) the output
    assert again.returncode == 0, again.stderr
    assert kq("verify", out).returncode == 0


# -- 3, 4, 7. validation gates verify and publish; validate == convert --validate; our model card ------
FIXTURE = Path(__file__).resolve().parents[1] / "kimi_quant" / "model" / "fixtures" / "tiny"  # trained, with tokenizer


@pytest.fixture(scope="module")
def converted_tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("val") / "out"
    r = kq("convert", FIXTURE, "-t", "a3", "-o", out, "--max-shard-size", "1MB", "-q")
    assert r.returncode == 0, r.stderr
    return out


def test_output_card_is_ours_and_links_the_source_card(tmp_path, tiny_source):
    out = tmp_path / "out"
    assert kq("convert", tiny_source, *target_args("a3"), "-o", out, "-q").returncode == 0
    card = (out / "README.md").read_text()
    assert (out / "SOURCE_README.md").read_text() == (Path(tiny_source) / "README.md").read_text()
    assert "model card generated by kimi-quant" in card
    assert "`local checkpoint`" in card and "W8A8_DYNAMIC" in card  # what, how
    assert str(Path(tiny_source).resolve()) not in card  # a local path names only someone's disk
    assert "[`SOURCE_README.md`](SOURCE_README.md)" in card
    assert "Not validated" in card and "kimi_quant_provenance.json" in card
    assert kq("verify", out).returncode == 0  # the card is not one of the hashed metadata files


def test_failed_validation_gates_verify_and_publish(converted_tiny, tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")  # the fake hub speaks LFS, not xet
    monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", True, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    out = tmp_path / "out"
    shutil.copytree(converted_tiny, out)
    r = kq("validate", FIXTURE, out, "-q", "--max-ppl-increase", "-50")  # a bound no quantized model meets
    assert r.returncode == 3, r.stderr
    assert "validation failed: perplexity rose" in error_line(r.stderr)
    assert f"report written to {out / VALIDATION}" in r.stdout
    report = json.loads((out / VALIDATION).read_text())
    assert report["passed"] is False and report["max_ppl_increase_pct"] == -50.0
    prov = json.loads((out / PROVENANCE).read_text())
    assert prov["validation"]["passed"] is False and prov["validation"]["ppl_quant"] == report["ppl_quant"]
    card = (out / "README.md").read_text()
    assert "**FAILED**" in card and f"{report['ppl_quant']:.4f}" in card and "-50.0%" in card
    v = kq("verify", out)
    assert v.returncode == 3 and v.stdout.startswith("ok: ")  # intact, but failing
    assert "validation failed" in error_line(v.stderr) and "--force" in error_line(v.stderr)
    p = kq("publish", out, "--repo-id", "org/name", env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "x"})
    line = error_line(p.stderr)
    assert p.returncode == 2 and "refusing to publish" in line and "validation failed" in line and "--force" in line

    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hubtools.fake_hub import FakeHub

    from kimi_quant.publish import publish

    hub = FakeHub(tmp_path / "hub", token="hf_test_write_token")
    try:
        res = publish(out, "org/name", endpoint=hub.endpoint, token="hf_test_write_token", backoff=0.01, force=True)
        remote = hub.files_at("org/name")
    finally:
        hub.close()
    assert res.commit and "**FAILED**" in remote["README.md"].decode()  # the card shows the numbers either way
    assert remote[VALIDATION] == (out / VALIDATION).read_bytes()

    # a passing re-validation clears the mark: one behaviour, whichever command wrote it
    ok = kq("validate", FIXTURE, out, "-q", "--max-ppl-increase", "1000")
    assert ok.returncode == 0, ok.stderr
    v = kq("verify", out)
    assert v.returncode == 0 and "validated: perplexity" in v.stdout and "bound 1000.0%" in v.stdout
    assert "| Result | passed |" in (out / "README.md").read_text()


def test_validate_is_refused_while_a_run_holds_the_output(tmp_path):
    """Standalone ``validate`` writes its report and the card into the output: it takes the output's lock."""
    from kimi_quant.lock import output_lock

    out = tmp_path / "out"
    assert kq("convert", FIXTURE, "-t", "950dt", "-o", out, "-q").returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    lock = output_lock(out).acquire()
    try:
        r = kq("validate", FIXTURE, out, "-q", "--max-ppl-increase", "1000")
        assert r.returncode == 2
        assert error_line(r.stderr) == (f"kimi-quant: error: {out} is being written by another kimi-quant run "
                                        f"(pid {os.getpid()}); wait for it to end, or choose another --output")
    finally:
        lock.release()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing written
    r = kq("validate", FIXTURE, out, "-q", "--max-ppl-increase", "1000")
    assert r.returncode == 0, r.stderr
    assert (out / VALIDATION).is_file() and not (out / ".kimi_quant.lock").exists()


def test_validate_and_convert_validate_record_the_same(converted_tiny, tmp_path):
    a = tmp_path / "a"
    shutil.copytree(converted_tiny, a)
    assert kq("validate", FIXTURE, a, "-q", "--max-ppl-increase", "1000").returncode == 0
    b = tmp_path / "b"
    r = kq("convert", FIXTURE, "-t", "a3", "-o", b, "--max-shard-size", "1MB", "-q", "--validate",
           "--max-ppl-increase", "1000")
    assert r.returncode == 0, r.stderr
    ra, rb = (json.loads((d / VALIDATION).read_text()) for d in (a, b))
    for k in ("ppl_bf16", "ppl_quant", "ratio", "passed", "max_ppl_increase_pct", "layers"):
        assert ra[k] == rb[k], k
    pa, pb = (json.loads((d / PROVENANCE).read_text())["validation"] for d in (a, b))
    assert pa == pb
    assert (a / "README.md").read_text() == (b / "README.md").read_text()


# -- 5. numbers that do not mislead ----------------------------------------------------------------------
def _frames(stderr: str) -> list[str]:
    return [f for f in stderr.replace("\r", "\n").splitlines() if f.startswith("convert ")]


def test_small_convert_rate_and_last_frame(tiny_source, tmp_path):
    r = kq("convert", tiny_source, *target_args("a3"), "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    done = [ln for ln in r.stdout.splitlines() if ln.startswith("done in")][0]
    assert "0.00 GB/s" not in done and re.search(r"in at \d+\.\d+ (MB|kB|GB)/s$", done), done
    n, noun = re.search(r": (\d+) (shards?) written", done).groups()
    assert noun == ("shard" if n == "1" else "shards"), done  # "1 shard written", never "1 shards"
    frames = _frames(r.stderr)
    assert frames[-1].startswith("convert a3: 100%"), frames  # a log's last frame is the end
    assert any("kernels" in f for f in frames[:3]), frames  # the wait before the first bytes is named


@pytest.mark.parametrize("workers", [1, 2])
def test_kernel_loading_is_left_out_of_the_rate(tiny_source, tmp_path, workers):
    from kimi_quant.convert import ConvertOptions, convert

    res = convert(str(tiny_source), ConvertOptions(target="a3", output=tmp_path / "out", workers=workers, quiet=True))
    assert res.startup_seconds is not None and 0 < res.startup_seconds < res.seconds
    assert res.gbps == pytest.approx(res.in_bytes_done / (res.seconds - res.startup_seconds) / 1e9)


def test_ctrl_c_while_compiling_kernels_stops_at_once(tiny_source, tmp_path):
    """A cold numba cache (a fresh NUMBA_CACHE_DIR): the bar says it compiles, a Ctrl-C ends the run in
    a moment with one line instead of waiting for the compilation."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NUMBA_CACHE_DIR": str(tmp_path / "numba-cold")}
    env.pop("KIMI_QUANT_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "kimi_quant.cli", "convert", str(tiny_source), "-t", "a3", "-o",
                          str(tmp_path / "out"), "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, start_new_session=True, preexec_fn=default_sigint)
    time.sleep(2.0)  # planned and compiling (a cold compile takes 10 s or more)
    if p.poll() is not None:
        pytest.skip("finished before the interrupt")
    t = time.monotonic()
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=60)
    took = time.monotonic() - t
    assert p.returncode == 130, err
    assert took < 5, f"{took:.1f} s from Ctrl-C to exit"
    assert any("compiling kernels" in f for f in _frames(err)), err
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("convert ")]
    assert lines == ["kimi-quant: interrupted; re-run the same command to resume"], err


def test_no_leaked_semaphore_warning_after_kill_9(mid_source, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "kimi_quant.cli", "convert", str(mid_source), *target_args("a3"),
                          "-o", str(out), "--max-shard-size", "1MB", "--workers", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    journal = out / JOURNAL_NAME
    while p.poll() is None and not (journal.exists() and '"unit"' in journal.read_text()):
        time.sleep(0.005)
    if p.poll() is not None:
        p.communicate()
        pytest.skip("finished before it could be killed")
    os.kill(p.pid, signal.SIGKILL)  # the driver alone: its workers and the resource tracker outlive it briefly
    _, err = p.communicate(timeout=60)  # returns once every process holding the pipes is gone
    assert "leaked semaphore" not in err, err


# -- 6. conventions ---------------------------------------------------------------------------------------
def test_debug_after_the_command(tmp_path, tiny_source):
    r = kq("convert", tiny_source, "-t", "a3", "-o", "/proc/kq-no-such/out", "--debug")
    assert r.returncode == 2 and "Traceback" in r.stderr
    assert r.stderr.splitlines()[-1].startswith("kimi-quant: error: /proc/kq-no-such")


def test_convert_local_source_refuses_revision_and_warns_on_staging_options(tiny_source, tmp_path):
    out = tmp_path / "out"
    line = error_line(kq("convert", tiny_source, "-t", "a3", "-o", out, "--revision", "main").stderr)
    assert "--revision main" in line and "local directory" in line and not out.exists()
    r = kq("convert", tiny_source, *target_args("a3"), "-o", out, "-q", "--max-disk", "1GB", "--keep-source")
    assert r.returncode == 0, r.stderr
    assert "warning: --max-disk, --keep-source ignored" in r.stderr


def test_mistyped_path_offline_fails_at_once(tmp_path):
    import time

    t = time.monotonic()
    r = kq("plan", "models/no-such-k3", "-t", "a3", env={"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://10.255.255.1"})
    assert time.monotonic() - t < 15  # the interpreter's start-up only: no network wait
    assert error_line(r.stderr) == ("kimi-quant: error: models/no-such-k3: no such directory; as a hub id: "
                                    "not looked up, HF_HUB_OFFLINE is set")


def test_default_work_dir_follows_the_cache_variables(monkeypatch, tmp_path):
    from kimi_quant.cache import cache_dir
    from kimi_quant.source.hub import default_work_dir

    for var in ("KIMI_QUANT_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert cache_dir() == Path.home() / ".cache" / "kimi-quant"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kimi-quant"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert default_work_dir("org/name") == tmp_path / "hf" / "kimi-quant" / "hub" / "org--name"
    monkeypatch.setenv("KIMI_QUANT_CACHE", str(tmp_path / "kq"))
    assert default_work_dir("org/name") == tmp_path / "kq" / "hub" / "org--name"


def test_publish_hub_revision_and_hidden_old_names(tmp_path):
    r = kq("publish", "--help")
    assert "--hub-revision" in r.stdout and "--push-to-hub" in r.stdout and "--force" in r.stdout
    assert not re.search(r"--branch|--repo-id|(?<!hub)-revision", r.stdout)
    for flag in ("--hub-revision", "--revision", "--branch"):  # the old names still work
        for repo in ("--push-to-hub", "--repo-id"):
            line = error_line(kq("publish", tmp_path / "none", repo, "a/b", flag, "x").stderr)
            assert "not a directory" in line
    assert "Missing option '--push-to-hub'" in kq("publish", tmp_path / "none").stderr


# -- 8. a bench checkpoint can be validated; the repo's hygiene -------------------------------------------
def test_bench_checkpoint_has_a_tokenizer_within_its_vocabulary(tmp_path):
    from kimi_quant.synth import synth
    from kimi_quant.runtime.text import token_windows

    out = synth("bench", tmp_path / "bench", sparse=True)  # headers only: the files around them are real
    assert (out / "tiktoken.model").is_file() and (out / "tokenizer_config.json").is_file()
    vocab = json.loads((out / "config.json").read_text())["text_config"]["vocab_size"]
    windows = token_windows(out, None, max_tokens=512, seq_len=128)
    assert windows and max(int(w.max()) for w in windows) < vocab


def test_demo_output_is_ignored_by_git():
    root = Path(__file__).resolve().parents[1]
    assert "/kimi-quant-demo/" in (root / ".gitignore").read_text().splitlines()
    manual = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    assert "install_olah.sh" in manual and "cos_min" in manual and "KIMI_QUANT_CACHE" in manual


def test_stored_rates_are_remeasured_when_the_measured_code_changes(tmp_path, monkeypatch):
    """`plan` reuses the codec rates it measured, but not across a change of the kernels or writers
    (a development install keeps its version number): the stored code fingerprint must match."""
    import json

    from kimi_quant import estimate

    monkeypatch.setenv("KIMI_QUANT_CACHE", str(tmp_path))
    measured = []

    def fake_measure():
        measured.append(1)
        return estimate.Rates({"FLOAT": 1e-9}, estimate._cpu_name(), estimate.__version__, "now",
                              code=estimate.code_fingerprint(), cpu_key=estimate.cpu_key())

    monkeypatch.setattr(estimate, "measure_rates", fake_measure)
    estimate.load_rates()
    estimate.load_rates()
    assert len(measured) == 1  # stored, then reused
    path = estimate.rates_path()
    stored = json.loads(path.read_text())
    assert stored["code"] == estimate.code_fingerprint()
    path.write_text(json.dumps({**stored, "code": "0" * 16}))  # measured with other kernels
    estimate.load_rates()
    assert len(measured) == 2
    # Same model name, other feature flags (a VM says "AMD EPYC" with and without AVX-512): measured again.
    assert json.loads(path.read_text())["cpu_key"] == estimate.cpu_key()
    path.write_text(json.dumps({**json.loads(path.read_text()), "cpu_key": "0" * 16}))
    estimate.load_rates()
    assert len(measured) == 3
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "cpu_key"}))
    estimate.load_rates()  # stored by a version that did not record the flags
    assert len(measured) == 4


_WORKERS_PROBE = """
import multiprocessing as mp, sys
from kimi_quant.convert import ConvertOptions, convert
from kimi_quant.executor import fork_server, local

seen = {}
start = local.LocalExecutor.start
def probed(self):
    out = start(self)
    seen["server"], seen["children"] = fork_server.fork_server_pid(), len(mp.active_children())
    return out
local.LocalExecutor.start = probed
res = convert(sys.argv[1], ConvertOptions(target="a3", output=sys.argv[2], workers=2, quiet=True))
print(seen["server"], seen["children"], res.converted_units)
"""


@pytest.mark.parametrize("blas_threads", ["1", None])
def test_workers_fork_from_the_driver_when_it_has_one_thread(tiny_source, tmp_path, blas_threads):
    """A driver with a single thread (the CLI sets OPENBLAS_NUM_THREADS=1 before numpy starts its pool)
    forks its workers itself: no fork server, no resource tracker, just the workers. One with more threads
    (numpy's BLAS pool) would fork them with locks possibly held: it starts them from a fork server."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if blas_threads:
        env["OPENBLAS_NUM_THREADS"] = blas_threads
    r = subprocess.run([sys.executable, "-c", _WORKERS_PROBE, str(tiny_source), str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    server, children, units = r.stdout.split()
    assert int(units) >= 1
    if blas_threads:
        assert server == "None" and children == "2", r.stdout  # the two workers, nothing else
    elif (os.cpu_count() or 1) > 1:  # numpy's BLAS pool has a thread per core beyond the first
        assert server != "None", r.stdout


_HEAP_PROBE = """
import os, resource, sys
import numpy as np
from kimi_quant.executor import local

if sys.argv[1] == "worker":
    local._init_worker(None, os.getpid())  # what every local worker runs first


def tensors_written():  # a writer holding 48 MiB of outputs for its turn, then writing and dropping them
    held = [np.ones(4 << 20, np.uint8) for _ in range(12)]
    del held


tensors_written(); tensors_written()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    tensors_written()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_workers_reuse_freed_output_buffers_without_page_faults():
    """glibc hands a freed heap top back to the kernel once more than twice its last mmap'd block is free
    there, so a worker that drops what its writer held faulted (and had zeroed) every page again, tensor
    after tensor. A local worker keeps up to ``KEEP_FREED`` for its next tensors: no fault once warm."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    faults = {}
    for kind in ("worker", "default"):
        r = subprocess.run([sys.executable, "-c", _HEAP_PROBE, kind], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        faults[kind] = int(r.stdout)
    assert faults["worker"] < 12, faults  # 12 blocks a round: not even one fault each
    assert faults["default"] >= 5 * 12, faults  # what it fixes: every block faulted in again, every round


def test_plan_wall_time_within_2x_of_the_tiny_models_convert(tmp_path):
    """plan's wall time (start-up included) against the measured wall of the same conversion, the bundled
    tiny model, default workers: within 2x either way. The best of two runs is taken (the first may build
    the kernels, which plan states apart); a machine loaded past twice its cores cannot time anything."""
    import os
    import time

    tiny = Path(__file__).resolve().parents[1] / "kimi_quant" / "model" / "fixtures" / "tiny"
    r = kq("plan", tiny, "-t", "950dt", "--json", tmp_path / "p.json")
    assert r.returncode == 0, r.stderr
    est = json.loads((tmp_path / "p.json").read_text())["totals"]["wall_seconds"]
    walls = []
    for k in range(2):
        t0 = time.perf_counter()
        c = kq("convert", tiny, "-t", "950dt", "-o", tmp_path / f"out{k}", "-q")
        walls.append(time.perf_counter() - t0)
        assert c.returncode == 0, c.stderr
    if os.getloadavg()[0] > 2 * (os.cpu_count() or 1):
        pytest.skip(f"load average {os.getloadavg()[0]:.1f}: too busy to time a run")
    assert min(walls) / 2 <= est <= min(walls) * 2, (est, walls)
