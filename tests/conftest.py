"""Shared test helpers. Sections are owned by different engineers: add yours, keep others intact."""

from __future__ import annotations

# --- resume / bad input / verify helpers (tests/test_resume.py, test_bad_input.py, test_verify.py,
# --- test_cli_errors.py) ----------------------------------------------------------------------------
import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# A K3.1-shaped checkpoint bigger than ``tiny`` (~27 MB, 290 tensors, several shards) so a conversion
# takes long enough to be killed part-way, still small enough for 2-core CI.
MID_TEXT = dict(hidden_size=256, vocab_size=2048, num_experts=8, moe_intermediate_size=256,
                routed_expert_hidden_size=256, intermediate_size=512)


def make_checkpoint(out: str | Path, text_overrides: dict | None = None, seed: int = 0, scatter: int = 4,
                    config_edit=None) -> Path:
    """Write a seeded-random K3.1-shaped BF16 checkpoint with the real tensor names.

    ``config_edit(config)`` may modify config.json (e.g. model_type) after the tensors are chosen.
    """
    from kimi_quant.model.presets import preset_config
    from kimi_quant.model.spec import spec_from_config
    from kimi_quant.synth import _assign_shards, random_tensor
    from kimi_quant.write import ShardWriter, write_json_atomic

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = preset_config("tiny")
    config["text_config"].update(text_overrides or {})
    spec = spec_from_config(config)
    tensors = spec.expected_tensors()
    shards = _assign_shards(tensors, 0, scatter=scatter)
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        w = ShardWriter(out / file, [(n, tensors[n][1], tensors[n][0]) for n in names])
        for n in names:
            arr = random_tensor(n, tensors[n][0], tensors[n][1], seed, spec.text.kda_num_heads)
            w.write(n, arr)
            weight_map[n] = file
            total += arr.nbytes
        w.commit()
    write_json_atomic(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    if config_edit:
        config_edit(config)
    write_json_atomic(out / "config.json", config)
    (out / "README.md").write_text("# test checkpoint\n")
    (out / "extra").mkdir(exist_ok=True)
    (out / "extra" / "notes.txt").write_text("copied small file in a subdirectory\n")
    return out


def codecs_ready() -> bool:
    """True once the quantization codecs work (until then, tests convert everything as FLOAT)."""
    try:
        from kimi_quant.quant import get_codec

        get_codec("W4A8_MXFP").quantize(np.ones((32, 64), np.float32))
        get_codec("W4A8_DYNAMIC").quantize(np.ones((32, 64), np.float32))
        return True
    except NotImplementedError:
        return False
    except TypeError:  # quantize(w, matmul) signatures
        return True


def target_args(target: str = "950dt") -> list[str]:
    return ["-t", target] + ([] if codecs_ready() else ["--override", "*=FLOAT"])


def kq(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the ``kimi-quant`` CLI in a subprocess; returns the CompletedProcess (text mode)."""
    e = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    e.pop("KIMI_QUANT_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "kimi_quant.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**e, **(env or {})})


def default_sigint() -> None:
    """``preexec_fn`` for a child the tests Ctrl-C: SIGINT back to its default, as under a terminal. A test
    run started in the background (``pytest &``) has SIGINT ignored, and Python keeps it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kq_popen(*args: str, env: dict | None = None) -> subprocess.Popen:
    e = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    e.pop("KIMI_QUANT_DEBUG", None)
    return subprocess.Popen([sys.executable, "-m", "kimi_quant.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=e)


JOURNAL_NAME = "kimi_quant_journal.jsonl"


def fresh_copy(template: str | Path, tmp_path: Path, name: str) -> Path:
    """A per-test copy of a module-scoped directory, for tests that damage or edit it."""
    d = tmp_path / name
    shutil.copytree(template, d)
    return d


def snapshot(d: str | Path, skip=(JOURNAL_NAME,)) -> dict[str, str]:
    """relative path -> sha256 of every file under ``d`` (the journal's event order may differ)."""
    d = Path(d)
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name not in skip}


#: a progress line in a log (kimi_quant.progress.LogBar): "calibrate a3:  37% 1.2 GB / 3.3 GB, ..."
PROGRESS_LINE = re.compile(r"^[a-z]+( \S+)?: +\d+% ")


def error_line(stderr: str) -> str:
    """The one-line error; fails the test if stderr holds a traceback or more than one line."""
    lines = [ln for ln in stderr.splitlines() if ln.strip() and "it/s]" not in ln and "B/s]" not in ln
             and not ln.startswith("convert ") and not PROGRESS_LINE.match(ln)]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("kimi-quant: error: "), stderr
    return lines[0]


def refused_calibrated_resume(source, out, made_with: tuple, resumed_with: tuple) -> tuple[str, list[str]]:
    """Calibrate ``source`` into ``out`` (a3, one worker) with ``made_with``, then resume with ``resumed_with``:
    the refusal's one line and the command it names as the one that made the output, split as a shell does."""
    import shlex

    base = ("convert", source, "-t", "a3", "-o", out, "-q", "--calibrate", "--workers", "1")
    r = kq(*base, *made_with)
    assert r.returncode == 0, r.stderr
    r = kq(*base, *resumed_with)
    line = error_line(r.stderr)
    assert r.returncode == 2, line
    return line, shlex.split(line.split("the command that made it: ", 1)[1])


def small_moe(R: int, I: int, E: int, T: int):
    """A routed MoE layer for the forward's tests: (its config, its weights by relative name, two [1, T, R]
    inputs); bf16-exact weights and inputs, 2 of E experts per token, seeded. The router's logits are ~N(0, 1), as a
    trained one's: unscaled ones (~N(0, R)) saturate the sigmoid to exactly 1.0 for several experts of a token, and
    the top-k of such a tie is whatever the device's sort picks (CUDA and the CPU differ on 11 of 256 tokens)."""
    from types import SimpleNamespace

    import torch

    g = torch.Generator().manual_seed(0)
    cfg = SimpleNamespace(num_experts=E, num_experts_per_token=2, num_expert_group=1, topk_group=1,
                          moe_renormalize=True, routed_scaling_factor=2.5, routed_expert_hidden_size=0,
                          hidden_act="silu", num_shared_experts=0)
    w = {"block_sparse_moe.gate.weight": torch.randn(E, R, generator=g) / R ** 0.5,
         "block_sparse_moe.gate.e_score_correction_bias": torch.zeros(E)}
    for e in range(E):
        for n, shape in (("w1", (I, R)), ("w3", (I, R)), ("w2", (R, I))):
            w[f"block_sparse_moe.experts.{e}.{n}.weight"] = torch.randn(*shape, generator=g).bfloat16().float() / 40
    return cfg, w, [torch.randn(1, T, R, generator=g).bfloat16().float() for _ in range(2)]


LOADABLE = ("quant_model_weights.safetensors.index.json", "quant_model_description.json")


def looks_loadable(out: str | Path) -> bool:
    return any((Path(out) / f).exists() for f in LOADABLE)


def assert_not_complete_looking(out: str | Path) -> None:
    """An unfinished output has no index/description, unless it stopped in the metadata phase, after
    every shard was complete and journaled (index and description are written last of all)."""
    import json

    out = Path(out)
    if not looks_loadable(out):
        return
    index = json.loads((out / LOADABLE[0]).read_text())
    vouched = {}
    for line in (out / JOURNAL_NAME).read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if ev.get("kind") == "unit":
            vouched[ev["file"]] = ev["size"]
    for f in set(index["weight_map"].values()):
        assert f in vouched and (out / f).stat().st_size == vouched[f], (f, sorted(p.name for p in out.iterdir()))


@pytest.fixture(scope="session")
def mid_source(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("mid") / "src", MID_TEXT)


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "src")
# --- end of resume / bad input / verify helpers ------------------------------------------------------


# --- kernel builds (tests/test_aot.py and the bit-identity tests) -----------------------------------------
#: the two builds of the conversion kernels every bit-identity test runs on
KERNEL_BUILDS = ["compiled", "jit"]


def compiled_kernels():
    """The ahead-of-time compiled kernels, built if missing. A machine with a C compiler must build
    them (a failure there is a bug); only one without any skips."""
    import shutil

    from kimi_quant.quant import aot

    k = aot.load()  # builds when missing, unless a build of this key failed before
    if k is None:
        if not (shutil.which("cc") or shutil.which("gcc") or os.environ.get("CC")):
            pytest.skip("no C compiler: the compiled kernels cannot be built here")
        why = aot.failed_path().read_text() if aot.failed_path().is_file() else "not trusted"
        pytest.fail(f"the compiled kernels did not load: {why}")
    return k


@contextlib.contextmanager
def kernels_build(build: str):
    """``load_kernels()`` returns ``build`` ("compiled" or "jit") inside."""
    from kimi_quant.quant import base

    saved = base._kernels
    if build == "compiled":
        base._kernels = compiled_kernels()
    else:
        from kimi_quant.quant import kernels

        base._kernels = kernels
    try:
        yield base._kernels
    finally:
        base._kernels = saved


# --- Ray: a worker killed while it runs a task (tests/test_calibrate_parallel.py, test_ray_executor.py) ----------
def running(title: str) -> list[int]:
    """PIDs of the processes whose title (Ray sets it to ``ray::<task>`` while one runs) starts with ``title``."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "cmdline").read_bytes().startswith(title.encode()):
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


@contextlib.contextmanager
def kill_the_first(title: str):
    """Within: a watcher SIGKILLs the first process seen running ``title`` (as a node that dies would lose its
    task); yields the list of killed PIDs (one at most)."""
    import threading
    import time

    killed, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            for pid in running(title):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield killed
    finally:
        stop.set()
        watcher.join()
