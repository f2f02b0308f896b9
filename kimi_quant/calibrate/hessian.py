"""Input Hessians of Linears, from the forward's ``observe_linear_inputs`` hook.

For a Linear ``y = x W^T`` with inputs x_1..x_n (the calibration tokens that reach it), GPTQ needs
``H = (1/n) sum_t x_t x_t^T`` ([K, K], float64). Linears fed the same tensor (q/k/v of one
attention, w1/w3 of one expert) share one accumulator: the product is formed once.
The sums live where the inputs are (the forward's device, ``calibrate/device.py``); what is handed out is
on the CPU. Each call's product ``x^T x`` is formed in float32 (half the time of float64; bf16 inputs make every
term exact, only the sum over that call's tokens rounds: ~1e-6 relative) and added to a float64 sum.
Above ``gptq_factor.FLOAT64_MAX_K`` inputs (a dense MLP's down projection, K ~ 34k: 9 GB in float64) the
sum itself is float32, accumulated in place (``addmm_``), and handed to GPTQ as it is, divided in
place: one K x K float32 matrix for the Hessian's whole life (GPTQ works in float32 at that size).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ..quant.gptq_factor import FLOAT64_MAX_K


class HessianCollector:
    """Call it as the forward's observer. Only names in ``want`` are accumulated (others pass by):
    callers narrow it to the Linears being quantized next, which bounds memory."""

    RECENT = 8  # inputs remembered for sharing (q/k/v and w1/w3 arrive back to back)

    def __init__(self):
        self._want: set[str] = set()
        self._key: dict[str, int] = {}  # name -> accumulator id
        self._sum: dict[int, torch.Tensor] = {}
        self._n: dict[int, int] = {}
        self._recent: list[tuple[torch.Tensor, int]] = []
        self._next = 0
        self._final: set[int] = set()  # float32 sums already divided in place and handed out
        self._last: tuple[int, np.ndarray] | None = None  # the float64 H last given out: sharers get one array

    def want(self, names: Iterable[str]) -> None:
        self._want.update(names)

    @property
    def wanted(self) -> frozenset[str]:
        """The names accumulated now (a ``Recorder`` observing elsewhere is given them)."""
        return frozenset(self._want)

    def __call__(self, name: str, x: torch.Tensor) -> None:
        if name not in self._want:
            return
        shared = next((k for r, k in self._recent if r is x), None)
        if shared is not None and self._key.get(name, shared) == shared:
            self._key[name] = shared  # same input object as a Linear seen just before: same H
            return
        xf = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        key = self._key.get(name)
        if key is None:
            key = self._key[name] = self._new(xf.shape[1], xf.device)
        self._add(name, key, xf)
        self._recent = (self._recent + [(x, key)])[-self.RECENT:]

    def _new(self, K: int, device) -> int:
        key, self._next = self._next, self._next + 1
        self._sum[key] = torch.zeros(K, K, dtype=torch.float64 if K <= FLOAT64_MAX_K else torch.float32,
                                     device=device)
        self._n[key] = 0
        return key

    def _open(self, name: str, key: int) -> None:
        if key in self._final:
            raise RuntimeError(f"{name}: inputs observed after its Hessian was handed out")
        if self._last is not None and self._last[0] == key:
            self._last = None  # the float64 hand-out was a copy: the next one sees the new inputs

    def _add(self, name: str, key: int, xf: torch.Tensor) -> None:
        self._open(name, key)
        add_gram(self._sum[key], xf)
        self._n[key] += xf.shape[0]

    def replay(self, records: Iterable[tuple]) -> None:
        """Add what a ``Recorder`` observed of other token passes (in another process), as if this collector
        had observed those passes itself, after those it has seen: the same sums, bit for bit (a float32
        product added to the float64 sum, or the rows themselves added in place above FLOAT64_MAX_K)."""
        for names, payload, n in records:
            key = next((self._key[m] for m in names if m in self._key), None)
            if key is None:
                key = self._new(payload.shape[1], payload.device)
            for m in names:
                self._key.setdefault(m, key)
            self._open(names[0], key)
            acc = self._sum[key]
            if acc.dtype == torch.float64:
                acc += payload.to(torch.float64)
            else:
                acc.addmm_(payload.t(), payload)
            self._n[key] += n

    def tokens(self, name: str) -> int:
        """How many token rows reached ``name`` (0: it was never applied)."""
        key = self._key.get(name)
        return 0 if key is None else self._n[key]

    def hessian(self, name: str) -> np.ndarray | None:
        """``(1/n) sum x x^T`` [K, K], or None when no token reached ``name``: float64, a new array, up to
        FLOAT64_MAX_K; above it the float32 sum itself, divided in place (no further inputs accepted)."""
        key = self._key.get(name)
        if key is None or self._n[key] == 0:
            return None
        h = self._sum[key]
        if h.dtype != torch.float64:  # float32 (large K): divided in place once, handed out without a copy
            if key not in self._final:  # (from a device: its one CPU copy, the device's sum freed)
                h = self._sum[key] = h.div_(self._n[key]).cpu()
                self._final.add(key)
            return h.numpy()
        if self._last is None or self._last[0] != key:
            self._last = (key, (h / self._n[key]).cpu().numpy())
        return self._last[1]

    def drop(self, names: Iterable[str]) -> None:
        """Forget ``names`` (their H is used); an accumulator goes when no name refers to it."""
        for n in names:
            self._want.discard(n)
            self._key.pop(n, None)
        live = set(self._key.values())
        for k in [k for k in self._sum if k not in live]:
            del self._sum[k], self._n[k]
            self._final.discard(k)
        self._recent = [(r, k) for r, k in self._recent if k in live]
        if self._last is not None and self._last[0] not in live:
            self._last = None

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._sum.values())


class Recorder(HessianCollector):
    """Observes like a HessianCollector given ``want``, but keeps what the collector would add, in order, for
    one to ``replay`` (a token partition observing in a Ray actor, the driver summing): per addition the names
    sharing the sum, the float32 product ``x^T x`` (the rows themselves above FLOAT64_MAX_K, where the sum
    is accumulated in place) and the token count. No K x K sum is held here."""

    def __init__(self, want: Iterable[str]):
        super().__init__()
        self.want(want)
        self._added: list[tuple[int, torch.Tensor, int]] = []

    def _new(self, K: int, device) -> int:
        key, self._next = self._next, self._next + 1
        self._n[key] = 0
        return key

    def _add(self, name: str, key: int, xf: torch.Tensor) -> None:
        payload = (xf.t() @ xf) if xf.shape[1] <= FLOAT64_MAX_K else xf.clone()
        self._added.append((key, payload, xf.shape[0]))

    @property
    def records(self) -> list[tuple[tuple[str, ...], torch.Tensor, int]]:
        names: dict[int, list[str]] = {}
        for name, key in self._key.items():
            names.setdefault(key, []).append(name)
        return [(tuple(sorted(names[key])), payload, n) for key, payload, n in self._added]


def add_gram(acc: torch.Tensor, xf: torch.Tensor) -> None:
    """``acc += xf^T xf`` for token rows ``xf`` [n, K] (float32): the product in float32, added to a float64
    ``acc`` (a float32 ``acc``, above FLOAT64_MAX_K: accumulated in place)."""
    if acc.dtype == torch.float64:
        acc += (xf.t() @ xf).to(torch.float64)
    else:
        acc.addmm_(xf.t(), xf)


def hessian_of_rows(batches: Iterable[torch.Tensor]) -> np.ndarray | None:
    """``(1/n) sum x x^T`` over the rows of ``batches`` ([n_b, K] each, summed in order, empty ones skipped),
    exactly as ``HessianCollector`` forms it from the same inputs observed one batch at a time (float64 up to
    FLOAT64_MAX_K); None when there is no row. Where a routed expert's GPTQ job runs, it forms its Hessians
    from its token rows with this (``jobs.ExpertJob``)."""
    acc, n = None, 0
    for x in batches:
        xf = x.reshape(-1, x.shape[-1]).to(torch.float32)
        if xf.shape[0] == 0:
            continue
        if acc is None:
            K = xf.shape[1]
            acc = torch.zeros(K, K, dtype=torch.float64 if K <= FLOAT64_MAX_K else torch.float32)
        add_gram(acc, xf)
        n += xf.shape[0]
    if acc is None:
        return None
    return (acc / n).numpy() if acc.dtype == torch.float64 else acc.div_(n).numpy()


def hessian_bytes(K: int) -> int:
    """Bytes of one [K, K] Hessian as the collector holds and hands it over (the float64 hand-out is a
    new array: count it with the sum)."""
    return K * K * (8 if K <= FLOAT64_MAX_K else 4)
