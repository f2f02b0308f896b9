"""The inside of one GPTQ lazy block on a CUDA device: ``gptq_kernels.gptq_block`` as a numba.cuda kernel.

Why: the reference torch loop (``gptq.gptq_run`` with ``kernel=False``) launches ~15 kernels per column, so
a [3072, 3584] matrix spends its time launching, not computing: on an H200 a whole GPTQ of one took 1.8 s,
about what the whole CPU path takes on one thread, whose block kernel is ~0.1 s of it. Here one launch does a
whole block: a thread owns one output row (GPTQ's rows are independent given the factor), keeps the row's
block of weights in its local memory, and repeats the CPU kernel's float32 operations column by column
(``TILE``-free: the GPU's threads are the tiles). The products between blocks stay torch matmuls.

The results are the CPU kernel's up to rounding: the device compiler may fuse a multiply and an add
(``w - e u``) into one rounding, so a code can differ where a value lies within an ulp of a rounding
boundary (``tests/test_gptq_cuda.py`` runs the kernel in numba's CUDA simulator, where the arithmetic is
numpy's, and compares it with the CPU kernel bit for bit; ``gptq.cuda_self_check`` runs the whole CUDA path
once per process against the CPU's before it is used). int and E2M1 grids only (the W4A8 schemes'); E4M3
grids use the torch loop.
"""

from __future__ import annotations

import math

import numpy as np

from .numba_cache import numba_cache_dir
from .numerics import E2M1_VALUES

numba_cache_dir()  # numba's cache only in a private directory, checked before numba reads any of it

from numba import cuda  # noqa: E402

KIND_INT, KIND_E2M1 = 0, 1  # gptq_kernels.KIND_* (E4M3 stays on the torch loop)
#: the most columns per block a thread keeps (``GPTQConfig.block_size`` above it uses the torch loop)
MAX_BLOCK = 256
#: threads per CUDA block
THREADS = 128


@cuda.jit(device=True)
def _rint(y):
    """Round half to even of a float32 (numpy's rint), from floor: exact below 2^23, and above it y is whole."""
    f = np.float32(math.floor(y))
    d = np.float32(y - f)
    if d > np.float32(0.5) or (d == np.float32(0.5) and math.fmod(f, np.float32(2.0)) != np.float32(0.0)):
        return np.float32(f + np.float32(1.0))
    return f


@cuda.jit(device=True)
def _e2m1_code(y):
    """The E2M1 magnitude code of y >= 0: thresholds passed (numerics.E2M1_THRESHOLDS: half to even)."""
    return (np.int64(y > np.float32(0.25)) + np.int64(y >= np.float32(0.75)) + np.int64(y > np.float32(1.25))
            + np.int64(y >= np.float32(1.75)) + np.int64(y > np.float32(2.5)) + np.int64(y >= np.float32(3.5))
            + np.int64(y > np.float32(5.0)))


@cuda.jit
def gptq_block_cuda(WT, ST, U1, e2m1, kind, qmin, qmax, CT, ET, sq):
    """GPTQ over one lazy block, one thread per output row n: WT float32 [B, N] the block's weights (read,
    not written), ST float32 [B, N] their scales, U1 float32 [B, B] the block of U, e2m1 float32 [8] the
    E2M1 magnitudes; writes codes CT int16 [B, N], errors ET float32 [B, N] and adds e^2 to sq float64 [N]
    (see ``gptq_kernels.gptq_block``)."""
    n = cuda.grid(1)
    B = WT.shape[0]
    if n >= WT.shape[1]:
        return
    w = cuda.local.array(MAX_BLOCK, np.float32)
    for i in range(B):
        w[i] = WT[i, n]
    acc = sq[n]
    for i in range(B):
        x = w[i]
        s = ST[i, n]
        if kind == KIND_INT:  # y clipped to [qmin - 1, qmax + 1] first: the same code, and floor stays in range
            c = min(max(_rint(min(max(np.float32(x / s), qmin - np.float32(1.0)), qmax + np.float32(1.0))), qmin), qmax)
            code = np.int16(c)
            v = np.float32(c * s)
        else:
            m = _e2m1_code(np.float32(abs(x) / s))
            mag = e2m1[m]
            neg = x < np.float32(0.0)
            code = np.int16(m + (8 if neg and m > 0 else 0))
            v = np.float32((-mag if neg else mag) * s)
        e = np.float32(np.float32(x - v) / U1[i, i])
        CT[i, n] = code
        ET[i, n] = e
        acc += np.float64(e) * np.float64(e)
        for j in range(i + 1, B):
            w[j] = np.float32(w[j] - np.float32(e * U1[i, j]))
    sq[n] = acc


_E2M1 = {}  # device -> the E2M1 magnitudes there


def run_block(WT, ST, U1, kind: int, qmin: float, qmax: float, CT, ET, sq) -> None:
    """Launch ``gptq_block_cuda`` on torch CUDA tensors, on torch's current stream (no synchronisation:
    the torch work around it is queued on the same stream)."""
    import torch

    dev = WT.device
    table = _E2M1.get(dev)
    if table is None:
        table = _E2M1[dev] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=dev)
    handle = torch.cuda.current_stream(dev).cuda_stream
    with cuda.gpus[dev.index or 0]:  # numba's context on the tensors' device (torch's primary context)
        stream = cuda.external_stream(handle) if handle else cuda.default_stream()
        arrays = [cuda.as_cuda_array(t, sync=False) for t in (WT, ST, U1, table, CT, ET, sq)]
        WTa, STa, U1a, ta, CTa, ETa, sqa = arrays
        N = WT.shape[1]
        gptq_block_cuda[(N + THREADS - 1) // THREADS, THREADS, stream](
            WTa, STa, U1a, ta, np.int64(kind), np.float32(qmin), np.float32(qmax), CTa, ETa, sqa)

