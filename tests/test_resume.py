"""Crash and resume: SIGKILL real ``kimi-quant convert`` runs, re-run, compare byte for byte.

The whole process group is killed (driver and worker processes), which is what a power loss or
an OOM kill of the session does. Every resumed output must equal an uninterrupted run's output in
every file (weights, index, description, config, provenance, copied files).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import interrupt_in_exec
from conftest import (JOURNAL_NAME, assert_not_complete_looking, default_sigint, error_line, kq, looks_loadable,
                      snapshot, target_args)

SHARD = "1MB"  # ~25-30 output shards: many units, so kills land mid-way


def convert_args(src, out, *extra, target="950dt"):
    return ["convert", src, *target_args(target), "-o", out, "--max-shard-size", SHARD, "--workers", "2", *extra]


def popen(args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("KIMI_QUANT_DEBUG", None)
    return subprocess.Popen([sys.executable, "-m", "kimi_quant.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, preexec_fn=default_sigint)


def kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.communicate(timeout=30)


def journal_events(out: Path) -> list[dict]:
    path = Path(out) / JOURNAL_NAME
    if not path.exists():
        return []
    evs = []
    for line in path.read_text().splitlines():
        try:
            evs.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return evs


def unit_lines(out: Path) -> int:
    return sum(1 for e in journal_events(out) if e.get("kind") == "unit")


def summary_counts(stdout: str) -> tuple[int, int]:
    m = re.search(r"nothing to convert, (\d+) shards? verified and kept", stdout)
    if m:
        return 0, int(m.group(1))
    m = re.search(r"(\d+) shards? written(?:, (\d+) verified and kept)?", stdout)
    assert m, stdout
    return int(m.group(1)), int(m.group(2) or 0)


@pytest.fixture(scope="module")
def clean(mid_source, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "out"
    t0 = time.perf_counter()
    r = kq(*convert_args(mid_source, out))
    secs = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    written, kept = summary_counts(r.stdout)
    assert kept == 0
    assert written == unit_lines(out) > 10
    verify(out)
    return {"out": out, "snap": snapshot(out), "secs": secs, "units": written}


def running_after(src, out, units: int) -> subprocess.Popen:
    """A conversion started and left running once ``units`` units are journaled (skips the test if
    it finished first)."""
    p = popen(convert_args(src, out))
    while p.poll() is None and unit_lines(out) < units:
        time.sleep(0.005)
    if p.poll() is not None:
        p.communicate()
        pytest.skip("finished before it could be stopped")
    return p


def interrupt(src, out, *, delay=None, after_units=None, extra=()) -> int:
    """Start a conversion and SIGKILL it after ``delay`` s or once ``after_units`` units are journaled.

    Returns the number of unit lines the journal held at the kill (-1 if the run finished first).
    """
    p = popen(convert_args(src, out, *extra))
    t0 = time.perf_counter()
    while p.poll() is None:
        if delay is not None and time.perf_counter() - t0 >= delay:
            break
        if after_units is not None and unit_lines(out) >= after_units:
            break
        time.sleep(0.005)
    if p.poll() is not None:
        p.communicate()
        return -1
    kill_group(p)
    return unit_lines(out)


def verify(out: Path) -> None:
    from kimi_quant.verify import verify_output

    verify_output(out)


def assert_not_loadable(out: Path):
    from kimi_quant.errors import KimiQuantError

    assert_not_complete_looking(out)
    with pytest.raises(KimiQuantError, match="incomplete|missing|journal"):
        verify(out)


def resume_and_compare(src, out, clean, killed_units: int, extra=()):
    r = kq(*convert_args(src, out, *extra))
    assert r.returncode == 0, r.stderr
    written, kept = summary_counts(r.stdout)
    assert written + kept == clean["units"]
    # Every shard the journal vouched for is kept; only the unfinished part is redone.
    assert kept == killed_units, (written, kept, killed_units)
    assert snapshot(out) == clean["snap"]
    assert not list(Path(out).rglob("*.partial"))
    verify(out)
    return written, kept


def test_kill_at_random_points_then_resume_is_byte_identical(mid_source, clean, tmp_path):
    rng = random.Random(20240531)
    fractions = sorted(rng.uniform(0.35, 0.95) for _ in range(3))
    # The delays come from the clean run's time; a run that went faster than that one (it ran on a busier
    # machine) finishes before every kill, so a last kill lands at a random journal position instead.
    kills = [{"delay": frac * clean["secs"]} for frac in fractions]
    kills.append({"after_units": rng.randint(1, clean["units"] - 2)})
    killed_any = 0
    for i, kill in enumerate(kills):
        if killed_any and "after_units" in kill:
            break
        out = tmp_path / f"out{i}"
        n = interrupt(mid_source, out, **kill)
        if n < 0:
            continue  # finished before the kill (a fast machine): nothing to resume
        killed_any += 1
        if not (out / JOURNAL_NAME).exists():
            continue  # killed before the journal started: a fresh run
        if not any(e.get("kind") == "complete" for e in journal_events(out)):
            assert_not_loadable(out)
        resume_and_compare(mid_source, out, clean, n)
    assert killed_any


def test_kill_by_journal_progress_redoes_only_the_rest(mid_source, clean, tmp_path):
    """Kill twice (at ~1/3 and ~2/3 of the units), resume each time; only unfinished shards are redone."""
    out = tmp_path / "out"
    third = clean["units"] // 3
    n1 = interrupt(mid_source, out, after_units=third)
    assert n1 >= third
    assert_not_loadable(out)
    n2 = interrupt(mid_source, out, after_units=n1 + third)
    if n2 >= 0:
        assert n2 >= n1
        assert_not_loadable(out)
    else:
        n2 = clean["units"]  # the second run finished before it could be killed
        assert snapshot(out) == clean["snap"]
        return
    written, kept = resume_and_compare(mid_source, out, clean, n2)
    assert written == clean["units"] - n2


def test_torn_last_journal_line_is_tolerated(mid_source, clean, tmp_path):
    """Power loss mid-append: the journal ends in half a line. Resume must still be exact and verifiable."""
    out = tmp_path / "out"
    n = interrupt(mid_source, out, after_units=clean["units"] // 2)
    assert n > 0
    path = out / JOURNAL_NAME
    with open(path, "a") as f:
        f.write('{"file": "quant_model_weights-00099-of-00099.safetensors", "kind": "un')
    resume_and_compare(mid_source, out, clean, n)
    # The events appended after the torn line must all be readable (none glued onto the torn text).
    assert unit_lines(out) >= clean["units"]
    assert journal_events(out)[-1]["kind"] == "complete"


def test_torn_first_line_is_a_fresh_start(mid_source, clean, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / JOURNAL_NAME).write_text('{"fingerprint": "ab')
    r = kq(*convert_args(mid_source, out))
    assert r.returncode == 0, r.stderr
    assert snapshot(out) == clean["snap"]


@pytest.fixture(scope="module")
def interrupted(mid_source, clean, tmp_path_factory):
    """An output killed after a few units, shared read-only (tests copy it before changing it)."""
    out = tmp_path_factory.mktemp("interrupted") / "out"
    n = interrupt(mid_source, out, after_units=3)
    assert n >= 3
    return {"out": out, "units": n, "snap": snapshot(out, skip=())}


def copy_of(interrupted, tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(interrupted["out"], out)
    return out


def test_stale_partials_are_cleaned_and_a_damaged_shard_is_redone(mid_source, clean, interrupted, tmp_path):
    out = copy_of(interrupted, tmp_path)
    (out / "quant_model_weights-00002-of-00099.safetensors.partial").write_bytes(b"junk" * 100)
    (out / "extra").mkdir(exist_ok=True)
    (out / "extra" / "notes.txt.partial").write_bytes(b"half a file")
    done = sorted({e["file"] for e in journal_events(out) if e.get("kind") == "unit"})
    victim = out / done[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    resume_and_compare(mid_source, out, clean, len(done) - 1)


def test_rerun_of_a_complete_output_redoes_nothing(mid_source, clean):
    r = kq(*convert_args(mid_source, clean["out"]))
    assert r.returncode == 0, r.stderr
    assert summary_counts(r.stdout) == (0, clean["units"])
    assert snapshot(clean["out"]) == clean["snap"]


def _recipe_file(tmp_path) -> Path:
    from importlib import resources

    text = resources.files("kimi_quant.recipe").joinpath("kimi_k3.toml").read_text()
    changed = text.replace('name = "kimi-k3-default"', 'name = "mine"').replace(
        '"mla.q_b_proj" = "W8A8_MXFP8"', '"mla.q_b_proj" = "FLOAT"')
    assert changed.count("mine") == 1
    recipe = tmp_path / "mine.toml"
    recipe.write_text(changed)
    return recipe


@pytest.mark.parametrize("change", ["target", "override", "max-shard-size", "recipe"])
def test_a_different_conversion_is_refused_and_nothing_is_lost(mid_source, interrupted, tmp_path, change):
    out = interrupted["out"]
    base = target_args()
    if change == "target":
        args = ["convert", mid_source, *target_args("a3"), "-o", out, "--max-shard-size", SHARD]
    elif change == "override":
        args = ["convert", mid_source, *base, "--override", "*.layers.1.*=FLOAT", "-o", out, "--max-shard-size", SHARD]
    elif change == "max-shard-size":
        args = ["convert", mid_source, *base, "-o", out, "--max-shard-size", "2MB"]
    else:
        args = ["convert", mid_source, *base, "--recipe", _recipe_file(tmp_path), "-o", out, "--max-shard-size", SHARD]
    r = kq(*args)
    assert r.returncode != 0
    line = error_line(r.stderr)
    assert str(out) in line and "--overwrite" in line
    if change in ("target", "recipe"):
        assert ("950dt" in line and "a3" in line) if change == "target" else "mine" in line, line
    assert snapshot(out, skip=()) == interrupted["snap"]


def test_overwrite_replaces_another_conversion(interrupted, tmp_path, tiny_source):
    out = copy_of(interrupted, tmp_path)
    (out / "user_file.txt").write_text("mine")
    args = ["convert", tiny_source, *target_args("a3"), "-o", out, "-q"]
    r = kq(*args)
    assert r.returncode != 0
    assert "--overwrite" in error_line(r.stderr)
    assert (out / "user_file.txt").exists()
    r = kq(*args, "--overwrite")
    assert r.returncode == 0, r.stderr
    verify(out)
    index = json.loads((out / "quant_model_weights.safetensors.index.json").read_text())
    shards = {p.name for p in out.glob("quant_model_weights-*")}
    assert shards == set(index["weight_map"].values())  # nothing left of the replaced conversion
    # only what kimi-quant wrote is replaced (issue 13): the user's file stays, and the run says so
    assert (out / "user_file.txt").read_text() == "mine"
    assert "kept 1 file(s) kimi-quant did not write" in r.stderr and "user_file.txt" in r.stderr


def test_a_foreign_directory_is_refused_even_with_overwrite(mid_source, tmp_path):
    """--overwrite replaces an earlier kimi-quant output, never a directory of someone else's files
    (`-o ~ --overwrite` must not empty a home directory)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "important.bin").write_bytes(b"x" * 10)
    (out / "sub").mkdir()
    for extra in ((), ("--overwrite",)):
        r = kq(*convert_args(mid_source, out), *extra)
        assert r.returncode == 2
        assert error_line(r.stderr) == (f"kimi-quant: error: {out} is not empty (it holds 'important.bin' and more) "
                                        "and is not a kimi-quant output; choose an empty or new --output "
                                        "(--overwrite only replaces an earlier kimi-quant output)")
        assert sorted(os.listdir(out)) == ["important.bin", "sub"]


def _children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_driver_killed_alone(mid_source, clean, tmp_path):
    """Only the driver dies (OOM killer): its worker processes must not corrupt the resumed run."""
    out = tmp_path / "out"
    p = running_after(mid_source, out, 3)
    kids = _children(p.pid)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()  # not communicate(): the orphaned workers still hold the output pipes open
    p.stdout.close()
    p.stderr.close()
    n = unit_lines(out)
    try:
        written, kept = summary_counts(kq(*convert_args(mid_source, out)).stdout)
        assert written + kept == clean["units"] and kept >= n
        assert snapshot(out) == clean["snap"]
        verify(out)
        deadline = time.time() + 5
        while time.time() < deadline and any(_alive(k) for k in kids):
            time.sleep(0.1)
        leaked = [k for k in kids if _alive(k)]
    finally:
        for k in kids:  # the workers this test started, by pid
            if _alive(k):
                os.kill(k, signal.SIGKILL)
    assert not leaked, f"{len(leaked)} worker/tracker processes outlive a SIGKILLed driver"


def _workers(driver: int) -> list[int]:
    """The driver's worker processes: its own children, or those of its fork server (a child whose command
    line names multiprocessing: the fork server, or the resource tracker, which has none)."""
    workers = []
    for k in _children(driver):
        try:
            with open(f"/proc/{k}/cmdline", "rb") as f:
                helper = b"multiprocessing" in f.read()
        except OSError:
            continue
        workers += _children(k) if helper else [k]
    return workers


def test_a_killed_worker_is_one_line_and_resumes(mid_source, clean, tmp_path):
    """The OOM killer picks a worker process: the run stops with one line that says what to do,
    leaves nothing that looks complete, and the same command resumes to the same bytes."""
    out = tmp_path / "out"
    p = popen(convert_args(mid_source, out))
    workers: list[int] = []
    while p.poll() is None and len(workers) < 2:  # --workers 2; looked up early, so the kill lands fast
        workers = _workers(p.pid)
    while p.poll() is None and unit_lines(out) < 1:
        time.sleep(0.001)
    if p.poll() is not None:
        pytest.skip("finished before the kill")
    for w in workers:
        os.kill(w, signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    if p.returncode == 0:  # the kill landed after the last unit: the output must simply be right
        assert snapshot(out) == clean["snap"]
        pytest.skip("the worker was killed after the last unit")
    assert p.returncode == 2, err
    assert re.fullmatch(r"kimi-quant: error: a worker process died while converting quant_model_weights-\S+ "
                        r"\(killed by a signal: the OOM killer\?\); completed shards are kept: re-run the same "
                        r"command to resume \(fewer --workers use less memory\)", error_line(err)), err
    assert_not_loadable(out)
    resume_and_compare(mid_source, out, clean, unit_lines(out))


@pytest.mark.parametrize("delay", [0.0, 0.1, 0.2])
def test_ctrl_c_during_start_up_is_one_line(mid_source, tmp_path, delay):
    """While the workers start (or their fork server still loads the kernels), a Ctrl-C must stop the run at
    once (not be swallowed), with one line and no traceback from a half-started worker."""
    out = tmp_path / "out"
    p = popen(convert_args(mid_source, out))
    while p.poll() is None and not _children(p.pid):  # the driver has started its workers (or fork server)
        time.sleep(0.002)
    time.sleep(delay)
    if p.poll() is not None:
        pytest.skip("finished before the interrupt")
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=60)
    if p.returncode == 0:  # only if the whole conversion beat the signal
        pytest.skip("finished before the interrupt")
    assert p.returncode == 130, err
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("convert ")]
    assert lines == ["kimi-quant: interrupted; re-run the same command to resume"], err


def test_ctrl_c_in_exec_code_during_start_up_exits_130(mid_source, tmp_path):
    """The Ctrl-C of the test above, landed at the exact point that made it fail now and then (returncode -2,
    killed by SIGINT, after the right line): with the fork server running, while the driver runs code that
    ``exec`` built from a string, i.e. defines a dataclass, as imports do (the converter's, when the CLI
    starts the fork server before importing it; kimi_quant.estimate's, while planning). CPython flags such a
    KeyboardInterrupt as unhandled although the CLI catches it, and under ``python -m`` killed itself with
    SIGINT at exit instead of exiting 130."""
    out, mark = tmp_path / "out", tmp_path / "fired"
    r = interrupt_in_exec.run(convert_args(mid_source, out), "workers", mark)
    assert mark.exists(), f"no dataclass was defined once the workers existed: nothing was interrupted\n{r.stderr}"
    assert r.returncode == 130, (mark.read_text(), r.stderr)
    lines = [ln for ln in r.stderr.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("convert ")]
    assert lines == ["kimi-quant: interrupted; re-run the same command to resume"], r.stderr
    assert not looks_loadable(out)


def test_ctrl_c_is_one_line_and_resumes(mid_source, clean, tmp_path):
    out = tmp_path / "out"
    p = running_after(mid_source, out, 3)
    os.killpg(p.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "Traceback" not in err
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("convert ")]
    assert lines == ["kimi-quant: interrupted; re-run the same command to resume"], err
    assert_not_loadable(out)
    resume_and_compare(mid_source, out, clean, unit_lines(out))
