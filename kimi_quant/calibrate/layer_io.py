"""What the calibrated driver reads and writes around a layer: the source's weights (``SourceWeights``), a
layer's weights with some replaced by their quantized values (``Overlay``, ``Readback``: what the device will
load), and the writer that fills a layer's output shards in plan order and journals each (``UnitWriter``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from ..plan import TensorPlan, UnitPlan
from ..recipe.recipe import FLOAT
from ..runtime.weights import WeightLoader
from ..source.safetensors import SafetensorsReader
from ..write import ShardWriter
from .layered import relative_name


# -- weights ------------------------------------------------------------------------------------------
class SourceWeights(WeightLoader):
    """The validator's weight loader over any Source (a hub source stages the shards a layer needs)."""

    def __init__(self, source, spec):
        super().__init__(source.root or ".", files=source, spec=spec)
        self.weight_map = source.weight_map()

    def drop(self, file: str) -> None:
        r = self._readers.pop(file, None)
        if r is not None:
            r.close()


class Overlay(Mapping):
    """A layer's weights with some replaced (dequantized in memory) and some read back from the
    output shards as written (routed experts: one at a time, never all resident)."""

    def __init__(self, base: Mapping, replaced: dict[str, torch.Tensor], readback=None):
        self._base, self._replaced, self._readback = base, replaced, readback

    def __getitem__(self, rel):
        t = self._replaced.get(rel)
        if t is not None:
            return t
        if self._readback is not None:
            t = self._readback(rel)
            if t is not None:
                return t
        return self._base[rel]

    def __contains__(self, rel):
        return rel in self._base

    def __iter__(self):
        return iter(self._base)

    def __len__(self):
        return len(self._base)


def dequantized(t: TensorPlan, out: dict[str, np.ndarray]) -> torch.Tensor:
    w = np.asarray(t.codec.dequantize(dict(out)), dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(w))


class Readback:
    """Dequantize a quantized tensor from the committed output shards (what the device will load)."""

    def __init__(self, out_dir: Path, units: list[UnitPlan], spec):
        self._where = {relative_name(spec, t.name): (t, u.file) for u in units for t in u.tensors
                       if t.scheme != FLOAT}
        self._out_dir = out_dir
        self._readers: dict[str, SafetensorsReader] = {}

    def __call__(self, rel: str) -> torch.Tensor | None:
        hit = self.written(rel)
        return None if hit is None else dequantized(*hit)

    def names(self) -> list[str]:
        """The relative names of the quantized tensors it reads back."""
        return list(self._where)

    def written(self, rel: str) -> tuple[TensorPlan, dict[str, np.ndarray]] | None:
        """``rel``'s plan and its tensors as written (the codec's parts), or None if it is not quantized here."""
        hit = self._where.get(rel)
        if hit is None:
            return None
        t, file = hit
        r = self._readers.get(file) or self._readers.setdefault(file, SafetensorsReader(self._out_dir / file))
        base = t.name.removesuffix(".weight")
        parts = {}
        for name, _, _ in t.outputs:
            parts[name[len(base) + 1:]] = np.array(r.array(name), copy=True)
            r.release(name)
        return t, parts

    def close(self) -> None:
        for r in self._readers.values():
            r.close()


# -- writing a layer's units --------------------------------------------------------------------------
class UnitWriter:
    """Writes tensors, in plan order, into a run of units; commits and journals each as it fills."""

    def __init__(self, out_dir: Path, units: list[UnitPlan], journal, made_from: dict, weights: SourceWeights,
                 progress):
        self._out_dir, self._journal, self._made_from, self._weights = out_dir, journal, made_from, weights
        self.reader = weights.reader  # the source shards' readers, for the GPTQ jobs' weights
        self._queue = [(u, t) for u in units for t in u.tensors]
        self._pos = 0
        self._writer: ShardWriter | None = None
        self._progress = progress

    def next_tensor(self) -> TensorPlan | None:
        return self._queue[self._pos][1] if self._pos < len(self._queue) else None

    def remaining(self) -> list[TensorPlan]:
        return [t for _, t in self._queue[self._pos:]]

    def put(self, t: TensorPlan, quantized: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray] | None:
        """Write ``t`` (``quantized``: its GPTQ output; None: the data-free rule); its outputs, or None."""
        from ..executor.unit import write_tensor

        unit, expected = self._queue[self._pos]
        if expected is not t:
            raise RuntimeError(f"calibrated writer: expected {expected.name}, got {t.name}")
        if self._writer is None:
            entries = [(n, dt, tuple(s)) for tp in unit.tensors for n, dt, s in tp.outputs]
            self._writer = ShardWriter(self._out_dir / unit.file, entries)
        out = write_tensor(self._writer, self._weights.reader, t, quantized)
        self._pos += 1
        self._progress(t.in_bytes)
        if self._pos == len(self._queue) or self._queue[self._pos][0] is not unit:
            size, sha = self._writer.commit()
            self._writer = None
            self._journal.record_unit(unit.file, size, sha, self._made_from[unit.file])
        return out

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
