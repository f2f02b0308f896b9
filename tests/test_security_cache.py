"""Issue 31, class 1: caches another local user shares (a 1777 KIMI_QUANT_CACHE / NUMBA_CACHE_DIR / HF_HOME)
must never let them plant what kimi-quant loads, nor redirect what it writes; a damaged cache entry is
rebuilt with one warning, never a crash.

The other user is real: a uid of its own (``setpriv``), planting links and pickles in a shared directory
under /tmp before the victim (this test's uid) runs the real CLI.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import compiled_kernels, error_line, kq  # noqa: E402

OTHER_UID = 4242
VICTIM_TEXT = "the victim's own file\n"


def _other_user_available() -> str | None:
    if os.getuid() != 0:
        return "needs root to act as a second local user (setpriv)"
    if shutil.which("setpriv") is None:
        return "setpriv is not installed"
    return None


needs_other_user = pytest.mark.skipif(_other_user_available() is not None, reason=str(_other_user_available()))


def as_other_user(code: str) -> None:
    """Run ``code`` (Python) as another local user, in isolated mode (nothing of this checkout imported)."""
    r = subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                        sys.executable, "-I", "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.fixture
def shared(tmp_path):
    """A directory every local user may write, sticky, as a cluster's shared cache; and a file of the victim's."""
    d = Path(tempfile.mkdtemp(prefix="kq-shared-", dir="/tmp"))
    os.chmod(d, 0o1777)
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    yield d, victim
    shutil.rmtree(d, ignore_errors=True)


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@needs_other_user
def test_a_shared_cache_gets_a_private_folder_and_links_planted_there_are_not_written_through(shared, tiny_source):
    d, victim = shared
    as_other_user(f"""
        import os
        for name in ("codec_rates.json", "codec_rates.json.partial", "codec_rates.json.tmp"):
            os.symlink({str(victim)!r}, os.path.join({str(d)!r}, name))
    """)
    r = kq("plan", tiny_source, "-t", "a3", "--no-shards", env={"KIMI_QUANT_CACHE": str(d)})
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == VICTIM_TEXT
    mine = d / f"kimi-quant-{os.getuid()}"
    assert _mode(mine) == 0o700 and os.lstat(mine).st_uid == os.getuid()
    rates = mine / "codec_rates.json"
    assert rates.is_file() and not rates.is_symlink() and _mode(rates) == 0o600
    assert not [p for p in mine.iterdir() if p.name.endswith((".tmp", ".partial"))]


@needs_other_user
def test_a_cache_folder_another_user_made_first_is_refused_in_one_line(shared, tiny_source):
    d, victim = shared
    as_other_user(f"""
        import os
        p = os.path.join({str(d)!r}, "kimi-quant-{os.getuid()}")
        os.mkdir(p); os.chmod(p, 0o777)
        os.symlink({str(victim)!r}, os.path.join(p, "codec_rates.json.partial"))
    """)
    r = kq("plan", tiny_source, "-t", "a3", "--no-shards", env={"KIMI_QUANT_CACHE": str(d)})
    assert r.returncode == 2
    line = error_line(r.stderr)
    assert "not private" in line and f"belongs to uid {OTHER_UID}" in line, line
    assert victim.read_text() == VICTIM_TEXT


@needs_other_user
def test_a_pickle_planted_in_a_shared_numba_cache_never_runs(shared, tmp_path):
    """numba unpickles its cache index (``*.nbi``) before any check: a pickle another user placed where
    numba would look for the kernels' index runs as the victim. kimi-quant points numba at a private
    folder instead, so nothing planted in the shared one is read."""
    d, _ = shared
    pwned = tmp_path / "pwned"
    # where numba's cache of kernels.py would be found in a shared NUMBA_CACHE_DIR: probe it with a private one
    probe = tmp_path / "probe"
    code = textwrap.dedent("""
        import numpy as np
        from kimi_quant.quant import kernels
        w = np.zeros((2, 32), np.uint16)
        kernels.int8_kernel(w, np.empty((2, 32), np.int8), np.empty((2, 1), np.float32))
        import numba.core.config as c, os
        print(c.CACHE_DIR, os.environ["NUMBA_CACHE_DIR"])
    """)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(probe)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    indexes = [p.relative_to(probe) for p in probe.rglob("*.nbi")]
    assert indexes, "numba wrote no cache index"

    class Payload:
        def __reduce__(self):
            return (open, (str(pwned), "w"))

    bomb = pickle.dumps(Payload())
    as_other_user(f"""
        import os
        for rel in {[str(p) for p in indexes]!r}:
            p = os.path.join({str(d)!r}, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            open(p, "wb").write({bomb!r})
    """)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(d)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert not pwned.exists()
    mine = str(d / f"kimi-quant-{os.getuid()}")
    assert r.stdout.split() == [mine, mine]


def _aot_probe(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_a_damaged_compiled_module_is_dropped_with_one_warning_not_a_crash(tmp_path):
    """A truncated kernel module used to SIGBUS every run until deleted; its digest no longer matches
    the one recorded at build: removed, one warning, numba's JIT kernels (or a rebuild) instead."""
    from kimi_quant.quant import aot

    compiled_kernels()
    built, digest = aot.module_path(), aot.digest_path()
    cache = tmp_path / "numba"
    where = _aot_probe("from kimi_quant.quant import aot; print(aot.module_path(), aot.digest_path())",
                       {"NUMBA_CACHE_DIR": str(cache)})
    target, target_digest = map(Path, where.stdout.split())
    shutil.copyfile(built, target)
    shutil.copyfile(digest, target_digest)
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    code = """
        from kimi_quant.quant import aot
        print(aot.state(), aot.load(build=False), aot.load(build=False))
    """
    r = _aot_probe(code, {"NUMBA_CACHE_DIR": str(cache)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["missing", "None", "None"]
    warnings = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(warnings) == 1 and "do not match the digest" in warnings[0] and "Traceback" not in r.stderr, r.stderr
    assert not target.exists()
    # a module without the digest recorded at its build is not loaded either
    shutil.copyfile(built, target)
    r = _aot_probe("from kimi_quant.quant import aot; print(aot.load(build=False))", {"NUMBA_CACHE_DIR": str(cache)})
    assert r.stdout.split() == ["None"] and "do not match the digest" in r.stderr
    # the whole module with its digest loads
    shutil.copyfile(built, target)
    shutil.copyfile(digest, target_digest)
    r = _aot_probe("from kimi_quant.quant import aot; print(aot.load(build=False) is not None)",
                   {"NUMBA_CACHE_DIR": str(cache)})
    assert r.stdout.split() == ["True"] and r.stderr == "", r.stderr


def test_a_link_at_the_module_path_is_not_followed(tmp_path, monkeypatch):
    """The old check followed a link and checked only its target's owner: any .so of the victim's
    (kimi-quant copies a checkpoint's small files into outputs) could be loaded as the kernels."""
    from kimi_quant.quant import aot

    compiled_kernels()
    built, digest = aot.module_path(), aot.digest_path()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    shutil.copyfile(digest, aot.digest_path())
    os.symlink(built, aot.module_path())
    assert aot.state() == "untrusted"
    assert aot.load(build=False) is None


@pytest.mark.parametrize("content", ['"a string"', "null", "[1, 2]", "[" * 100000 + "]" * 100000,
                                     '{"per_byte": {"W4A8_MXFP": NaN}, "cpu": "x", "tool_version": "x", '
                                     '"measured_at": "x", "code": "x", "cpu_key": "x"}',
                                     "FIFO", "\xff\xfe not utf-8"])
def test_a_damaged_rates_file_is_measured_again_with_one_warning(tmp_path, monkeypatch, caplog, content):
    import logging

    from kimi_quant import estimate

    monkeypatch.setenv("KIMI_QUANT_CACHE", str(tmp_path / "cache"))
    path = estimate.rates_path()
    if content == "FIFO":
        os.mkfifo(path)  # would block a plain open() forever
    else:
        path.write_bytes(content.encode("utf-8", "surrogateescape") if content[0] != "\xff" else b"\xff\xfe x")
    measured = []

    def fake_measure():
        measured.append(1)
        return estimate.Rates({"FLOAT": 1e-9}, "cpu", estimate.__version__, "now",
                              code=estimate.code_fingerprint(), cpu_key=estimate.cpu_key())

    monkeypatch.setattr(estimate, "measure_rates", fake_measure)
    with caplog.at_level(logging.WARNING):
        r = estimate.load_rates()
    assert measured == [1] and r.per_byte == {"FLOAT": 1e-9}
    assert len([rec for rec in caplog.records if str(path) in rec.getMessage()]) == 1, caplog.text
    if content != "FIFO":  # a FIFO is someone's: left alone, and measured each time
        assert estimate.load_rates().where == str(path) and measured == [1]


def test_rates_edited_in_place_are_not_trusted(tmp_path, monkeypatch):
    """Plausible but edited numbers (a rate scaled down 1000x: absurd estimates) fail the file's digest."""
    from kimi_quant import estimate

    monkeypatch.setenv("KIMI_QUANT_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(estimate, "measure_rates", lambda: calls.append(1) or estimate.Rates(
        {"FLOAT": 1e-9}, "cpu", estimate.__version__, "now", code=estimate.code_fingerprint(),
        cpu_key=estimate.cpu_key()))
    estimate.load_rates()
    d = json.loads(estimate.rates_path().read_text())
    d["per_byte"]["FLOAT"] = 1e-12
    estimate.rates_path().write_text(json.dumps(d))
    assert estimate.load_rates().per_byte == {"FLOAT": 1e-9} and calls == [1, 1]


def test_a_link_at_a_hub_partial_download_is_not_written_through(tmp_path, monkeypatch):
    """The staging name of a download is predictable (a rerun resumes it): a link placed there is
    removed, never written through."""
    import huggingface_hub.constants as c
    from hubtools.fake_hub import FakeHub

    from kimi_quant.source.hub import HubSource

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", True, raising=False)
    hub = FakeHub(tmp_path / "hub")
    try:
        hub.create("org/small", private=False)
        content = {"config.json": b'{"model_type": "kimi_k3"}\n'}
        hub.new_commit("org/small", "main", hub.resolve("org/small", "main"),
                       {n: hub.file_entry(d, lfs=False) for n, d in content.items()}, "small files")
        victim = tmp_path / "victim.txt"
        victim.write_text(VICTIM_TEXT)
        src = HubSource("org/small", endpoint=hub.endpoint, work_dir=tmp_path / "work", backoff=0.01, retries=3)
        part = src.stager.partial("config.json")
        part.parent.mkdir(parents=True)
        os.symlink(victim, part)
        try:
            assert src.fetch("config.json").read_bytes() == content["config.json"]
        finally:
            src.close()
    finally:
        hub.close()
    assert victim.read_text() == VICTIM_TEXT
    assert _mode(tmp_path / "work" / ".kq-hub") == 0o700


def test_an_unsafe_cache_variable_is_refused_before_anything_is_written(tmp_path, tiny_source):
    """A cache folder others may write (group-writable, not sticky) is refused, one line."""
    d = tmp_path / "team"
    d.mkdir()
    os.chmod(d, 0o777)
    r = kq("plan", tiny_source, "-t", "a3", "--no-shards", env={"KIMI_QUANT_CACHE": str(d / "kq")})
    assert r.returncode == 2
    assert "writable by others and not sticky" in error_line(r.stderr)
    assert not (d / "kq").exists() or not any((d / "kq").iterdir())
