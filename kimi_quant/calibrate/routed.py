"""A MoE layer's routed experts as the calibrated driver hands them out: the token rows the router sends each
one (or every token), and the job that quantizes it from them (``jobs.ExpertJob``).

The driver's forward computes the experts' common input once (the latent projection ``z`` and the router's
choice, per calibration batch); each expert's job carries only its own rows and forms its Hessians and w2's
input where it runs. So the routed experts' share of the forward and of the Hessians (most of a MoE layer's)
spreads over the workers with their GPTQ, and grows with the calibration tokens on the workers, not on the
driver.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..plan import TensorPlan
from .jobs import ExpertJob, GPTQJob


@dataclass(frozen=True)
class Routing:
    """Per calibration batch ``(z, idx, wts)`` as ``forward.moe_many`` hands them back: the experts' input
    [n, R], the chosen experts [n, k] and their weights."""

    batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    def tokens_per_expert(self, experts: int) -> list[int]:
        """How many tokens the router sends each expert (over every batch)."""
        counts = torch.zeros(experts, dtype=torch.int64)
        for _, idx, _ in self.batches:
            counts += torch.bincount(idx.reshape(-1).cpu(), minlength=experts)[:experts]
        return counts.tolist()

    @property
    def tokens(self) -> int:
        return sum(z.shape[0] for z, _, _ in self.batches)

    def rows(self, expert: int, every_token: bool) -> tuple[np.ndarray, ...]:
        """The expert's input rows per batch, float32 on the CPU: the tokens routed to it in token order (the rows
        ``moe_many`` applies it to), or with ``every_token`` all of them; batches it sees nothing of are left out."""
        out = []
        for z, idx, _ in self.batches:
            if not every_token:
                tok = (idx == expert).nonzero(as_tuple=True)[0]
                if tok.numel() == 0:
                    continue
                z = z[tok]
            out.append(np.ascontiguousarray(z.detach().to("cpu", torch.float32).numpy()))
        return tuple(out)


@dataclass(frozen=True)
class RoutedExpert:
    """One routed expert of a layer to be quantized from its token rows: ``tensors``: all of its tensors, plan
    order; ``every_token``: its rows are every token of the layer (``--expert-tokens all``, or an under-routed
    expert holding MXFP4 values), else those routed to it."""

    index: int
    tensors: tuple[TensorPlan, ...]
    routing: Routing
    every_token: bool
    text: object

    def job(self, reader, jobs: list[GPTQJob], phases) -> ExpertJob:
        """The ExpertJob of ``jobs`` (its calibrated Linears, plan order); w2's input needs w1 and w3 even where they
        are not calibrated themselves (then read here)."""
        from ..executor.unit import source_values

        given = {j.matmul: j.weight for j in jobs}
        if any(j.matmul == "down" for j in jobs) and not {"gate", "up"} <= set(given):
            with phases("read"):
                for t in self.tensors:
                    if t.matmul in ("gate", "up") and t.matmul not in given:
                        given[t.matmul] = source_values(reader, t)
        empty = np.empty((0, 0), np.float32)
        with phases("rows"):
            rows = self.routing.rows(self.index, self.every_token)
        name = self.tensors[0].name.rsplit(".", 2)[0]  # ...experts.E
        return ExpertJob(name, tuple(jobs), rows, given.get("gate", empty), given.get("up", empty), self.text)
