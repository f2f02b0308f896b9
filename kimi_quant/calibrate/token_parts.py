"""The calibrated driver's forward over the calibration tokens, as sections of a layer run in order.

``TokenPart`` holds some passes of the tokens (``fw.State`` per pass of at most ``PASS_TOKENS``) and their state
between layers, and runs the sections of a layer the driver needs between its GPTQ stages: the attention (observed,
or again with the quantized weights), the MLP's observed pass (which also gives the routed experts' rows), the
layer's output, and the head. ``LocalForward`` is one TokenPart with every pass, in the driver, on its device (the
default); ``ray_forward.RayForward`` gives each pass to a Ray actor, so that the forward runs data-parallel over
the tokens (``--executor ray`` with more than one pass). Both drive the same TokenPart code, and the per-pass
arithmetic of the forward does not depend on the other passes, so the states and the Hessians come out the same
bit for bit either way (``hessian.Recorder``: what a partition observed is replayed into the driver's sums in pass
order).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import nullcontext

import torch

from ..errors import KimiQuantError
from ..runtime import forward as fw
from .device import DeviceWeights
from .hessian import HessianCollector
from .layer_io import Overlay
from .state import state_layout


#: times parts of the forward may be lost (``PartitionLost``) before the run stops (a re-run resumes it)
MAX_LOSSES = 3


class PartitionLost(KimiQuantError):
    """A part of the forward's state was lost with the process holding it (a Ray actor whose node died): the
    driver redoes the layer from the last one checkpointed."""


class TokenPart:
    """Passes of the calibration tokens (``states``: one ``fw.State`` per pass) and the sections of a layer on
    them. ``observer``: what sees each Linear's input (a HessianCollector, a Recorder), or None."""

    def __init__(self, tcfg, states: list[fw.State]):
        self.tcfg, self.states = tcfg, states
        self._parts: list[tuple] | None = None  # the attention's output, between the sections of a layer

    def attention(self, i: int, w: Mapping, observer=None, act: dict | None = None) -> None:
        with _observing(observer):
            self._parts = fw.layers_attention(self.tcfg, i, w, self.states, act)

    def mlp(self, i: int, w: Mapping, observer=None, propagate: bool = True) -> list:
        """The MLP's observed pass: the routed experts' input per pass, ``[(z, idx, wts)]``; the experts themselves
        run only when the state propagates in BF16 (then it is the layer's output)."""
        routing: list = []
        with _observing(observer):
            out = fw.layers_mlp(self.tcfg, i, w, self._parts, experts=set() if propagate else None, routing=routing)
        if not propagate:
            self.states, self._parts = out, None
        return routing

    def output(self, i: int, w: Mapping, act: dict | None) -> None:
        """The layer's output from ``w`` (the weights as written): the state for the next layer."""
        self.states, self._parts = fw.layers_mlp(self.tcfg, i, w, self._parts, act), None

    def head(self, gw: Mapping, observer) -> None:
        with _observing(observer):
            for st in self.states:
                fw.head(self.tcfg, gw, st)


def _observing(observer):
    return fw.observe_linear_inputs(observer) if observer is not None else nullcontext()


class LocalForward:
    """Every pass in this process, on ``device`` (``calibrate/device.py``); ``phases`` times the Hessians."""

    def __init__(self, tcfg, states: list[fw.State], device: torch.device, phases):
        self._part, self.device, self._phases = TokenPart(tcfg, states), device, phases

    def layout(self) -> list:
        """Per pass the dtype and shape of its state's tensors (``state.state_layout``)."""
        return state_layout(self._part.states)

    def passes(self) -> Iterator[fw.State]:
        """The state of each pass, in order (to checkpoint it)."""
        return iter(self._part.states)

    def _observer(self, coll: HessianCollector | None):
        return None if coll is None else self._phases.observer(coll)

    def attention(self, i: int, w: Mapping, coll: HessianCollector | None, replaced: dict | None = None,
                  act: dict | None = None) -> None:
        """Layer i's attention on every pass, observed by ``coll``; with ``replaced`` (the quantized Linears,
        dequantized) again as the device computes it."""
        if replaced is not None:
            w = DeviceWeights(Overlay(w, replaced), self.device)
        self._part.attention(i, w, self._observer(coll), act)

    def mlp(self, i: int, w: Mapping, coll: HessianCollector, propagate: bool) -> list:
        return self._part.mlp(i, w, self._observer(coll), propagate)

    def output(self, i: int, w: Mapping, replaced: dict, readback, act: dict | None) -> None:
        self._part.output(i, DeviceWeights(Overlay(w, replaced, readback), self.device), act)

    def head(self, gw: Mapping, coll: HessianCollector) -> None:
        self._part.head(gw, self._observer(coll))

    def close(self) -> None:
        pass
