"""Where the calibrated driver's forward and Hessians run (``--device cpu|cuda|npu``).

One code path for every device: a layer's weights go to the device as the forward looks them up
(``DeviceWeights``: the layer's non-expert tensors once per pass, a routed expert each time it is looked up,
so at most the experts in use are there), the per-window states stay there between layers (``states_to``;
back on the CPU only to be checkpointed), and the Hessians are summed there (the collector allocates its
sums where its inputs are) and come back to the CPU as the numpy arrays GPTQ jobs take, wherever those run.
On the CPU every move is the tensor itself (``Tensor.to`` of a tensor already there): the bytes are those of
the plain CPU forward. On a GPU they are close to the CPU's, not equal (other kernels, other summation
orders, atomic adds in the MoE's scatter): docs/calibration.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from ..errors import KimiQuantError
from ..quant.gptq import torch_device
from ..runtime import forward as fw
from ..runtime.weights import ROUTED_EXPERT

__all__ = ["DeviceWeights", "free_bytes", "full_float32", "states_to", "synchronize", "torch_device"]


class DeviceWeights(Mapping):
    """``base`` (relative names -> tensors) with every tensor on ``device``: the non-expert ones moved once and
    kept for this mapping's life (a pass of the forward looks them up per window), a routed expert's moved on
    each lookup and not kept (the forward looks each up once per pass and drops it)."""

    def __init__(self, base: Mapping, device: torch.device):
        self._base, self.device = base, device
        self._held: dict[str, torch.Tensor] = {}

    def __getitem__(self, rel: str) -> torch.Tensor:
        t = self._held.get(rel)
        if t is not None:
            return t
        t = self._base[rel].to(self.device)
        if not ROUTED_EXPERT.match(rel):
            self._held[rel] = t
        return t

    def __contains__(self, rel: object) -> bool:
        return rel in self._base

    def __iter__(self) -> Iterator[str]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


def states_to(states: list[fw.State], device: torch.device) -> list[fw.State]:
    """The states (the running residual and the closed blocks per window batch) on ``device``."""
    return [fw.State(s.x.to(device), [b.to(device) for b in s.blocks]) for s in states]


@contextmanager
def full_float32(device: torch.device) -> Iterator[None]:
    """Within: float32 products on ``device`` in full float32 (CUDA would otherwise be allowed TF32 in its
    convolutions, a 10-bit mantissa: the Hessians and the propagated state would lose what the CPU keeps)."""
    if device.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a phase's wall time includes its kernels); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize()


def free_bytes(name: str) -> int | None:
    """The free memory of the device ``--device name`` as its driver reports it (what other processes on it
    left), or None for the CPU. Opens the device in this process (the local workers are forked from a fork server
    started afresh, so this does not reach them)."""
    if name == "cpu":
        return None
    dev = torch_device(name)
    try:
        if dev.type == "cuda":
            return int(torch.cuda.mem_get_info(dev)[0])
        return int(torch.npu.mem_get_info(dev)[0])  # torch_npu mirrors torch.cuda's memory API
    except RuntimeError as e:  # busy (exclusive mode, held by another process), or a broken driver
        what = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise KimiQuantError(f"--device {name}: the device cannot be opened ({what}); use --device cpu") from e
