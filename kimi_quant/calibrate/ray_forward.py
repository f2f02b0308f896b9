"""The calibrated forward data-parallel over the calibration tokens: each pass of ``PASS_TOKENS`` tokens is a Ray
actor (``convert --calibrate --executor ray`` with more tokens than one pass, on the CPU).

Each actor keeps its pass's state between layers and runs the sections of a layer the driver asks for
(``token_parts.TokenPart``), all actors at once; the layer's weights reach them through Ray's object store (once
per layer: the non-expert weights from the source, the quantized ones as written; no shared filesystem). What an
actor observes comes back as a ``hessian.Recorder``'s additions, which the driver replays into its sums in pass
order, and the routed experts' rows come back per pass, as the driver would have made them: the Hessians, the
jobs and the bytes are those of a run with the forward in the driver. So more calibration tokens cost more
machines, not more hours in the driver. The driver still gathers the state after each layer, to checkpoint it.

An actor that is lost (its node died) is ``token_parts.PartitionLost``: the driver says so in one line and redoes
the layer from the last one checkpointed, in new actors (the same bytes; after ``MAX_RETRIES`` losses the run
stops, and the same command resumes it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import torch

from .. import __version__
from ..errors import KimiQuantError
from ..executor.ray_executor import SYSTEM_ERRORS, one_line
from ..runtime import forward as fw
from ..runtime.weights import ROUTED_EXPERT
from .hessian import HessianCollector, Recorder
from .layer_io import Overlay, dequantized
from .state import state_layout
from .token_parts import PartitionLost, TokenPart

import ray  # noqa: E402 - after ray_executor, which turns a missing Ray into one line


class _Written:
    """A layer's quantized tensors as written (``{rel: (plan, parts)}``), dequantized on lookup: the actors'
    ``layer_io.Readback``."""

    def __init__(self, written: dict):
        self._written = written

    def __call__(self, rel: str) -> torch.Tensor | None:
        hit = self._written.get(rel)
        return None if hit is None else dequantized(*hit)


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class _Passes:
    """One actor: some passes of the tokens and their state (``TokenPart``); its forward's threads are set by the
    driver (``RayForward._share_cores``)."""

    def __init__(self, tcfg, states: list[fw.State], version: str):
        import kimi_quant

        if kimi_quant.__version__ != version:
            raise KimiQuantError(f"a Ray node runs kimi-quant {kimi_quant.__version__} but the driver runs "
                                 f"{version}; install the same version on every node")
        self._part = TokenPart(tcfg, states)

    def node(self) -> tuple[str, int]:
        """(this actor's Ray node, that node's cores)."""
        return ray.get_runtime_context().get_node_id(), os.cpu_count() or 1

    def threads(self, n: int) -> None:
        torch.set_num_threads(max(1, n))

    @staticmethod
    def _recorder(want) -> Recorder | None:
        return Recorder(want) if want else None

    @torch.inference_mode()
    def attention(self, i: int, w: dict, want, replaced: dict | None, act: dict | None) -> tuple[list, None]:
        rec = self._recorder(want)
        self._part.attention(i, Overlay(w, replaced or {}), rec, act)
        return (rec.records if rec else []), None

    @torch.inference_mode()
    def mlp(self, i: int, w: dict, want) -> tuple[list, list]:
        rec = self._recorder(want)
        routing = self._part.mlp(i, w, rec, propagate=True)
        return (rec.records if rec else []), routing

    @torch.inference_mode()
    def output(self, i: int, w: dict, replaced: dict, written: dict, act: dict | None) -> None:
        self._part.output(i, Overlay(w, replaced, _Written(written)), act)

    @torch.inference_mode()
    def head(self, gw: dict, want) -> tuple[list, None]:
        rec = self._recorder(want)
        self._part.head(gw, rec)
        return (rec.records if rec else []), None

    def layout(self) -> list:
        return state_layout(self._part.states)

    def states(self) -> list[fw.State]:
        return self._part.states


class RayForward:
    """``token_parts.LocalForward``'s sections, each pass of ``states`` in a Ray actor of its own (spread over
    the cluster's nodes). The Ray session is the runner's (``ray_jobs.RayRunner``)."""

    def __init__(self, tcfg, states: list[fw.State], phases, threads: int):
        self._phases = phases
        self._layer: tuple[int, object] | None = None  # (layer, its non-expert weights in the object store)
        self._actors = [_Passes.options(scheduling_strategy="SPREAD").remote(tcfg, [st], __version__)
                        for st in states]
        self.partitions = len(self._actors)
        self.threads = self._share_cores(threads)

    def _share_cores(self, most: int) -> list[int]:
        """Give each actor the cores of its node shared among the actors there (at most ``most``: the driver's
        forward threads), so that actors placed together do not oversubscribe their node; returns them."""
        nodes = list(self._get([a.node.remote() for a in self._actors]))
        together = {n: sum(1 for m, _ in nodes if m == n) for n, _ in nodes}
        threads = [max(1, min(most, cores // together[n])) for n, cores in nodes]
        list(self._get([a.threads.remote(t) for a, t in zip(self._actors, threads)]))
        return threads

    def _get(self, refs: list, first: int = 0, of: int | None = None):
        """The actors' answers, in pass order (a lost actor: one line); ``refs`` are those of the passes from
        ``first`` on, of ``of``."""
        of = of or len(refs)
        for k, ref in enumerate(refs, start=first):
            try:
                yield ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None) or e
                if isinstance(cause, KimiQuantError):
                    raise cause from None
                raise KimiQuantError(f"the forward of calibration pass {k + 1} of {of} failed in its Ray "
                                     f"actor: {type(cause).__name__}: {one_line(cause)}") from e
            except (ray.exceptions.RayActorError, *SYSTEM_ERRORS) as e:  # the executor's rule, and a dead actor
                raise PartitionLost(f"the Ray actor holding calibration pass {k + 1} of {of} was lost "
                                    f"({type(e).__name__}: {one_line(e)})") from e

    def _weights(self, i: int, w: Mapping):
        """Layer i's non-expert weights, put in the object store once for the layer."""
        if self._layer is None or self._layer[0] != i:
            self._layer = None  # the last layer's go first
            self._layer = (i, ray.put({k: w[k] for k in w if not ROUTED_EXPERT.match(k)}))
        return self._layer[1]

    def _replay(self, refs: list, coll: HessianCollector | None) -> list:
        """Replay each actor's Hessian terms (its answer: ``(records, rest)``) into ``coll``, in pass order; the
        rests, in pass order."""
        rest = []
        for records, more in self._get(refs):
            if coll is not None:
                with self._phases("hessians"):
                    coll.replay(records)
            rest.append(more)
        return rest

    def layout(self) -> list:
        """Per pass the dtype and shape of its state's tensors (``state.state_layout``)."""
        return [ts for part in self._get([a.layout.remote() for a in self._actors]) for ts in part]

    def passes(self) -> Iterator[fw.State]:
        """The state of each pass, in order, one actor's at a time (to checkpoint it: the driver never holds all)."""
        for k, a in enumerate(self._actors):
            part, = self._get([a.states.remote()], first=k, of=len(self._actors))
            yield from part

    def attention(self, i: int, w: Mapping, coll: HessianCollector | None, replaced: dict | None = None,
                  act: dict | None = None) -> None:
        want = coll.wanted if coll is not None else None
        put = ray.put(replaced) if replaced is not None else None
        self._replay([a.attention.remote(i, self._weights(i, w), want, put, act) for a in self._actors], coll)

    def mlp(self, i: int, w: Mapping, coll: HessianCollector, propagate: bool) -> list:
        if not propagate:
            raise RuntimeError("the Ray forward propagates the quantized state only")
        routed = self._replay([a.mlp.remote(i, self._weights(i, w), coll.wanted) for a in self._actors], coll)
        return [b for part in routed for b in part]

    def output(self, i: int, w: Mapping, replaced: dict, readback, act: dict | None) -> None:
        """The layer's output in every actor, from its weights as written: the quantized ones the driver
        dequantized (``replaced``) and the rest read back here (the routed experts, as their codecs' parts)."""
        written = {rel: readback.written(rel) for rel in readback.names() if rel not in replaced}
        extra = {rel: w[rel] for rel in w if ROUTED_EXPERT.match(rel) and rel not in written}  # kept in BF16
        base = self._weights(i, w)
        if extra:
            base = ray.put({**ray.get(base), **extra})
        replaced, written = ray.put(replaced), ray.put(written)
        refs = [a.output.remote(i, base, replaced, written, act) for a in self._actors]
        del written, extra
        list(self._get(refs))
        self._layer = None

    def head(self, gw: Mapping, coll: HessianCollector) -> None:
        put = ray.put(dict(gw.items()))
        self._replay([a.head.remote(put, coll.wanted) for a in self._actors], coll)

    def close(self) -> None:
        for a in self._actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        self._actors = []
