"""The ahead-of-time compiled kernels (``kimi_quant.quant.aot``): workers start without numba, calls the
compiled signature does not cover go to numba's JIT, a failed build is said once and falls back, and
a module file anyone else could have written is never loaded. Their bytes are checked against the
numpy reference with the JIT kernels' in test_quant_properties / test_int4_group / test_kernels_exhaustive."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kimi_quant.dtypes import f32_to_bf16
from kimi_quant.quant import aot
from kimi_quant.quant import kernels as jit

from conftest import compiled_kernels


def _weights(shape=(6, 96), seed=0):
    return f32_to_bf16((0.02 * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32))


def test_fork_server_preload_imports_no_numba():
    """What the workers inherit: the unit code and the loaded kernels, with no numba in the process."""
    compiled_kernels()  # built (once per machine) before the child looks
    code = textwrap.dedent("""
        import sys
        import kimi_quant.executor.preload
        from kimi_quant.quant import load_kernels
        print(type(load_kernels()).__name__, "numba" in sys.modules, "llvmlite" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["CompiledKernels", "False", "False"], r.stdout


def test_arguments_outside_the_signature_are_refused():
    """pycc's entry points check nothing: an F-ordered or read-only output, a strided input or another
    dtype would be read or written as if C-contiguous. Each is a TypeError, and nothing is written."""
    k = compiled_kernels()
    w = _weights()
    want_q, want_s = np.empty((6, 48), np.uint8), np.empty((6, 3), np.uint8)
    assert jit.mxfp4_kernel(w, want_q, want_s) == -1
    q, s = np.empty((6, 48), np.uint8), np.empty((6, 3), np.uint8)
    assert k.mxfp4_kernel(w, q, s) == -1  # the compiled path, default margin
    assert np.array_equal(q, want_q) and np.array_equal(s, want_s)
    q[:] = 0
    s[:] = 0

    wide = np.zeros((6, 192), np.uint16)
    wide[:, ::2] = w
    readonly = np.zeros((6, 48), np.uint8)
    readonly.setflags(write=False)
    bad_calls = [
        (w, np.zeros((48, 6), np.uint8).T, s),  # F-ordered output
        (wide[:, ::2], q, s),  # strided input
        (w.astype(np.int16), q, s),  # another dtype
        (w, readonly, s),  # read-only output
        (w, q),  # too few arguments
        (w, q, s, "0.1"),  # not a number
        (w.reshape(-1), q, s),  # 1-D
    ]
    for args in bad_calls:
        with pytest.raises(TypeError, match="mxfp4_kernel takes C-contiguous arrays"):
            k.mxfp4_kernel(*args)
    assert not q.any() and not s.any() and not readonly.any()

    from kimi_quant.quant import get_codec

    codec = get_codec("W4A8_DYNAMIC")
    mine, want = codec.alloc(w.shape, "gate"), codec.alloc(w.shape, "gate")
    args = ("weight", "weight_scale", "scale_bias")
    assert jit.int4_kernel(w, *(want[a] for a in args)) == k.int4_kernel(w, *(mine[a] for a in args)) == -1
    for a in args:
        assert np.array_equal(mine[a].view(np.uint8), want[a].view(np.uint8)), a
    with pytest.raises(TypeError, match="int4_group_kernel"):
        k.int4_group_kernel(w, 32.0, 32, *(mine[a] for a in args))  # a float group size


def test_nonfinite_row_is_reported_by_the_compiled_kernel():
    k = compiled_kernels()
    w = _weights()
    w[4, 7] = 0x7F80  # +Inf
    assert k.int8_kernel(w, np.empty((6, 96), np.int8), np.empty((6, 1), np.float32)) == 4
    assert k.mxfp8_kernel(w, np.empty((6, 96), np.uint8), np.empty((6, 3), np.uint8)) == 4


def test_failed_build_falls_back_to_jit_and_is_not_retried(tmp_path, tiny_source):
    """A compiler that fails (here: CC is /bin/false) leaves a one-line .failed file and numba's JIT
    kernels; the next process with the same key does not try again."""
    if shutil.which("false") is None:
        pytest.skip("no false(1)")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "CC": shutil.which("false"),
           "LDSHARED": shutil.which("false")}
    code = textwrap.dedent("""
        import sys, time
        from kimi_quant.quant import aot, load_kernels
        t = time.monotonic()
        k = load_kernels()
        print(k.__name__ if hasattr(k, "__name__") else type(k).__name__, aot.state(), round(time.monotonic() - t, 1))
    """)
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    name, state, _ = first.stdout.split()
    assert (name, state) == ("kimi_quant.quant.kernels", "failed"), first.stdout
    failed = list((tmp_path / "cache" / "kimi_quant_aot").glob("*.failed"))
    assert len(failed) == 1
    text = failed[0].read_text()
    assert text.count("\n") == 1 and "Error" in text, text  # one line: the exception that stopped the build
    assert first.stderr == "", first.stderr  # the compiler's failure is in the file, not on the terminal
    stamp = failed[0].stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    name, state, _ = again.stdout.split()
    assert (name, state) == ("kimi_quant.quant.kernels", "failed"), again.stdout
    # not retried: the failure record is the first run's, untouched (a retry rewrites it)
    assert list((tmp_path / "cache" / "kimi_quant_aot").glob("*.failed")) == failed
    assert failed[0].stat().st_mtime_ns == stamp and failed[0].read_text() == text
    # plan says which kernels run, and how to try the build again
    from conftest import kq

    plan = kq("plan", str(tiny_source), "-t", "a3", env=env)
    assert plan.returncode == 0, plan.stderr
    line = [ln for ln in plan.stdout.splitlines() if ln.startswith("kernels")]
    assert len(line) == 1 and "numba's JIT" in line[0] and str(failed[0]) in line[0], plan.stdout


def test_module_others_can_write_is_not_loaded(tmp_path, monkeypatch):
    """Loading a module runs its code: one whose file the group or others may write is refused."""
    built, built_digest = aot.module_path(), aot.digest_path()
    compiled_kernels()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    target = aot.module_path()  # the cache directory is made (private) on the way
    shutil.copyfile(built, target)
    shutil.copyfile(built_digest, aot.digest_path())
    os.chmod(target, 0o775)
    assert aot.load(build=False) is None
    assert aot.state() == "untrusted"
    from kimi_quant.estimate import kernels_build

    assert kernels_build()["build"] == "jit"
    os.chmod(target, 0o755)
    assert aot.load(build=False) is not None
