"""GPTQ's CUDA block kernel (quant/gptq_cuda.py).

Everywhere: the kernel runs in numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, a process of its own: numba reads
it at import), where its arithmetic is numpy's float32, and must give the CPU kernel's codes, errors and sums of
e^2 bit for bit, rounding ties included. On a machine with CUDA: the real kernel against the torch loop."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

SIMULATED = textwrap.dedent("""
    import sys
    import numpy as np
    try:
        from numba import cuda  # noqa: F401
    except ImportError:  # a numba without its CUDA target (numba-cuda not installed)
        print("no numba.cuda")
        sys.exit(0)
    from kimi_quant.quant import gptq_cuda as gc
    from kimi_quant.quant.gptq_kernels import gptq_block
    from kimi_quant.quant.numerics import E2M1_VALUES

    # rint: numpy's half to even, on ties, near-ties and ordinary values of both signs
    ys = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.4999998, 0.49999997, -7.5, 7.5, 8.5, 0.0, -0.0, 1e-8,
                   4194304.5, 8388607.0, 12.25], np.float32)
    got = np.array([gc._rint(y) for y in ys], np.float32)
    assert np.array_equal(got, np.rint(ys)), (got, np.rint(ys))

    rng = np.random.default_rng(1)
    # a small block, and the default block size (128 columns: the thread's local array holds them all); N not a
    # multiple of the threads per CUDA block, so the last threads have no row
    for B, N in ((24, 150), (128, 130)):
        A = rng.standard_normal((B, B)).astype(np.float32)
        U1 = np.triu(A) * np.float32(3.0 / B) + np.float32(2.0) * np.eye(B, dtype=np.float32)
        S = rng.uniform(0.05, 0.3, (B, N)).astype(np.float32)
        W = rng.standard_normal((B, N)).astype(np.float32)
        W[0, :40] = S[0, :40] * (np.arange(40, dtype=np.float32) % 9 - 4 + np.float32(0.5))  # exact ties, column 0
        for kind, qmin, qmax, scale in ((gc.KIND_INT, -8.0, 7.0, 1.0), (gc.KIND_E2M1, 0.0, 0.0, 0.5)):
            outs = []
            for cuda in (False, True):
                CT = np.zeros((B, N), np.int16)
                ET = np.zeros((B, N), np.float32)
                sq = np.full(N, 0.25)
                Wk = W * np.float32(scale)
                if cuda:
                    gc.gptq_block_cuda[(N + gc.THREADS - 1) // gc.THREADS, gc.THREADS](
                        Wk, S, U1, E2M1_VALUES, np.int64(kind), np.float32(qmin), np.float32(qmax), CT, ET, sq)
                else:
                    gptq_block(Wk.copy(), S, U1, kind, np.float32(qmin), np.float32(qmax), CT, ET, sq)
                outs.append((CT, ET, sq))
            (c0, e0, s0), (c1, e1, s1) = outs
            assert len(np.unique(c0)) > 5, np.unique(c0)
            assert np.array_equal(c0, c1) and np.array_equal(e0.view(np.uint32), e1.view(np.uint32)), (B, kind)
            assert np.array_equal(s0, s1)
    print("same")
""")


def test_the_kernel_in_the_simulator_repeats_the_cpu_kernel_bit_for_bit():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", SIMULATED], capture_output=True, text=True, env=env, timeout=600)
    if r.stdout.strip() == "no numba.cuda":
        pytest.skip("this numba has no CUDA target (nor its simulator)")
    assert r.returncode == 0 and r.stdout.strip() == "same", r.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec_name", ["W4A8_DYNAMIC", "W4A8_MXFP"])
def test_the_cuda_kernel_agrees_with_the_torch_loop(codec_name):
    """The kernel path of ``gptq_run`` on CUDA against the reference torch loop on the same device: the
    same codes but for a stray one (fused multiply-adds), the same error to 1e-4."""
    from kimi_quant.quant import get_codec
    from kimi_quant.quant.gptq import GPTQConfig, _cuda_kernel, gptq_run
    from kimi_quant.quant.gptq_factor import hessian_factor

    rng = np.random.default_rng(0)
    N, K = 256, 384
    w = (0.02 * rng.standard_normal((N, K))).astype(np.float32)
    x = rng.standard_normal((2048, K)).astype(np.float32)
    H = x.T.astype(np.float64) @ x / len(x)
    codec = get_codec(codec_name)
    matmul = "down" if codec_name == "W4A8_DYNAMIC" else None
    grid = codec.gptq_grids(w, matmul, codec.data_free_codes(w, matmul))[0]
    cfg = GPTQConfig(device="cuda")
    f = hessian_factor(H, K, cfg.damp, cfg.act_order, torch.device("cuda"))
    assert _cuda_kernel(grid, cfg.block_size) is not None
    c1, s1 = gptq_run(w, f.U, grid, cfg, f.perm, kernel=True)
    c0, s0 = gptq_run(w, f.U, grid, cfg, f.perm, kernel=False)
    assert np.mean(c1 != c0) < 1e-3
    np.testing.assert_allclose(s1.sum(), s0.sum(), rtol=1e-4)


class _CpuBlocks:
    """A stand-in for ``gptq_cuda`` on CPU tensors: its ``run_block`` is the CPU kernel on a copy of the block
    (the CUDA kernel does not write WT), so ``_gptq_run_cuda``'s own work (the transposes, the products between
    blocks, the permutation) can be checked here against the CPU path."""

    MAX_BLOCK = 256

    @staticmethod
    def run_block(WT, ST, U1, kind, qmin, qmax, CT, ET, sq):
        from kimi_quant.quant.gptq_kernels import gptq_block

        gptq_block(WT.numpy().copy(), ST.numpy(), U1.contiguous().numpy(), kind, np.float32(qmin), np.float32(qmax),
                   CT.numpy(), ET.numpy(), sq.numpy())


def test_the_cuda_path_around_the_kernel_repeats_the_cpu_path():
    """The self-check that gates the CUDA kernel, run with the CPU kernel in its place: no code may differ."""
    from kimi_quant.quant.gptq import cuda_self_check

    assert cuda_self_check(_CpuBlocks, device="cpu") == 0.0
    # and it does catch a kernel that is wrong
    class Off(_CpuBlocks):
        @staticmethod
        def run_block(WT, ST, U1, kind, qmin, qmax, CT, ET, sq):
            _CpuBlocks.run_block(WT * 1.5, ST, U1, kind, qmin, qmax, CT, ET, sq)

    with pytest.raises(RuntimeError, match="codes differ from the CPU kernel's"):
        cuda_self_check(Off, device="cpu")
