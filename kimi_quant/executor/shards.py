"""The driver's scheduler: every core busy at any shard size, with no extra cost when shards are many.

A unit of the plan (one output shard) is the unit of resume and of the journal. While at least as
many shards are left as there are workers, each shard is one *whole* job: a worker writes it front
to back, hashing on a second thread as it writes, and renames it (as before shards could be split).
So is a shard whose output is mostly copied bytes (``copies_mostly``) at any point of a run. The
other last shards of a run (all of them, when there are fewer shards than workers: any checkpoint
under ~8 GB at the default 4 GiB) are split into *parts*, runs of consecutive tensors worth about ``PART_BYTES`` of
input, so every core works on them. The driver opens every shard (``ShardAssembly`` writes its
header into a temporary file with a per-run random name), hands its jobs to the executor, tells
the assembly which byte ranges are in as parts finish (a driver thread hashes the file in order as
it fills), and gets ``(size, sha256)`` once the shard is complete under its final name. The bytes
equal a single streaming writer's, and the journal still gets one record per shard.

Splitting costs a second read of the shard for its sha256 (~0.1 core-s per GB of output on top of
the hash itself, which a whole job does too) and a few ms per part.

With an executor whose workers are on other nodes (``executor.remote``: Ray), or more workers than
the driver's hashing keeps up with (``DRIVER_HASH_MAX_SLOTS``), the driver does not read split
shards back: once a shard's parts are all in, a *finish* job hashes, fsyncs and renames it on
whichever worker runs it (the last shard of a run then waits for one hash: ~0.6 s per GB of output).

No worker ever creates a file: every temporary file is the driver's, so on an error or Ctrl-C the
driver removes exactly its own run's files, and a task of a stopped run (still running, or started
late) finds its file gone and leaves nothing behind.
"""

from __future__ import annotations

from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Callable

from ..plan import TensorPlan, UnitPlan
from ..recipe.recipe import FLOAT
from ..source.base import Source
from ..write import ShardAssembly, on_local_file_system
from .base import Executor

#: Input bytes per part: ~0.1 core-s of work, against a few ms of start-up (reader, task). Large
#: enough that a K3.1 expert matrix is never alone, small enough that the last part of a run is short.
PART_BYTES = 96 * 2**20

#: A shard with at least this share of its output bytes copied as they are is one whole job (``copies_mostly``)
COPIED_SHARE = 0.75

#: The driver hashes each open shard on one thread (~1.8 GB/s of output, ~6 GB/s of input): enough
#: for this many workers (~0.75 GB/s of input each); with more, finish jobs hash on the workers.
DRIVER_HASH_MAX_SLOTS = 8


def split(tensors: list[TensorPlan], part_bytes: int, taper: int = 0) -> list[list[TensorPlan]]:
    """Consecutive runs of ``tensors``, each closed once it holds ``part_bytes`` of input.

    ``taper`` (the run's last shard: the number of workers): the parts shrink towards the end, each at
    most a 1/(2 taper) share of the input left when it opens, down to ``part_bytes / 8``, so the run
    ends on small parts: the last worker to finish, and the driver hashing the last bytes that land,
    keep the other cores waiting for little."""
    parts: list[list[TensorPlan]] = []
    left = sum(t.in_bytes for t in tensors)
    size = limit = part_bytes
    for t in tensors:
        if size >= limit:
            parts.append([])
            size = 0
            if taper:
                limit = min(part_bytes, max(part_bytes // 8, left // (2 * taper)))
        parts[-1].append(t)
        size += t.in_bytes
        left -= t.in_bytes
    return parts


def copies_mostly(unit: UnitPlan) -> bool:
    """Whether most of ``unit``'s output is copied as it is (FLOAT tensors; MXFP4 experts repacked for
    950dt). Writing such bytes costs a worker about what their sha256 costs (~1.6 GB/s a core), and a
    shard's sha256 runs on one thread however the shard is split: one whole job, writing on one core
    while its hash thread hashes on another, is as fast, with no parts, no turns at the file and no
    second read of it."""
    copied = sum(t.out_bytes for t in unit.tensors if t.repack or (t.scheme == FLOAT and not t.packed))
    return copied >= COPIED_SHARE * unit.out_bytes


class OpenShard:
    """One output shard being written: its assembly and the part jobs not yet submitted.

    ``whole``: one job writes, hashes and renames the entire shard (what a worker did before shards
    were split; nothing is read back), else it is split into parts of about ``part_bytes``."""

    def __init__(self, unit: UnitPlan, out_dir: Path, paths: dict[str, str], part_bytes: int, hash_here: bool,
                 whole: bool = False, identities: dict[str, str] | None = None, taper: int = 0,
                 take_turns: bool = False):
        self.unit, self.paths, self.whole = unit, paths, whole
        entries = [(name, dt, tuple(shape)) for t in unit.tensors for name, dt, shape in t.outputs]
        self.assembly = ShardAssembly(out_dir / unit.file, entries, hash_here=hash_here and not whole)
        offsets = self.assembly.offsets
        self.jobs: deque[dict] = deque()
        for i, tensors in enumerate([unit.tensors] if whole else split(unit.tensors, part_bytes, taper)):
            names = [name for t in tensors for name, _, _ in t.outputs]
            needs = sorted({f for t in tensors for f in t.files})
            start = offsets[names[0]] if names else 0
            end = start + sum(t.out_bytes for t in tensors)
            self.jobs.append({"file": unit.file, "part": i, "partial": self.assembly.tmp.name,
                              "tensors": [t.to_json() for t in tensors], "whole": whole, "take_turns": take_turns,
                              "offsets": {n: offsets[n] for n in names}, "span": [start, end],
                              "needs": needs, "identities": {f: identities[f] for f in needs} if identities else {}})
        self.parts_left = len(self.jobs)

    def finish_job(self) -> dict:
        return {"file": self.unit.file, "finish": True, "partial": self.assembly.tmp.name, "size": self.assembly.size}


def run_shards(executor: Executor, units: list[UnitPlan], out_dir: Path, source: Source, *, unhashed: set[str],
               on_inputs: Callable[[dict[str, str]], None], on_shard: Callable[[UnitPlan, int, str], None],
               part_bytes: int = PART_BYTES) -> None:
    """Write every shard of ``units`` into ``out_dir`` with ``executor``.

    ``on_shard(unit, size, sha256)`` once a shard is complete under its final name (in completion
    order); ``on_inputs({file: sha256})`` for source files a part hashed (``unhashed`` names those
    still to hash: each goes to the first part reading it). A source shard is released (a staged hub
    download deleted) once every output shard needing it is complete, and a new output shard is
    opened only while its source shards fit the staging window (``source.can_stage``). On any error
    the open shards' temporary files are removed before it propagates; the caller then aborts the
    executor, whose running workers find their file gone.
    """
    out_dir = Path(out_dir)
    users = Counter(f for u in units for f in u.needs)
    pending = deque(units)
    feeding: deque[OpenShard] = deque()  # open shards with part jobs still to submit
    live: dict[Future, OpenShard] = {}  # shards with every part in: their completion (size, sha256) -> shard
    running: dict[Future, tuple[OpenShard, dict]] = {}
    depth = 2 * executor.slots  # a queued job starts the moment a worker frees up, not after a driver round trip
    hash_here = not executor.remote and executor.slots <= DRIVER_HASH_MAX_SLOTS
    # the writers of a split shard take turns at its file (PartWriter) where they share a node's flock
    take_turns = not executor.remote and on_local_file_system(out_dir)
    opened: list[OpenShard] = []  # every shard opened and not complete (aborted on an error)
    ok = False

    def completing(shard: OpenShard) -> None:
        """Every part is in: wait for the shard to be hashed and renamed (here, or by a finish job)."""
        fut = shard.assembly.done if hash_here else executor.submit(shard.finish_job(), {}, str(out_dir))
        live[fut] = shard

    def complete(shard: OpenShard, size: int, sha: str) -> None:
        """The shard is under its final name: journal it, release source shards no other shard needs."""
        opened.remove(shard)
        on_shard(shard.unit, size, sha)
        for f in shard.unit.needs:
            users[f] -= 1
            if users[f] == 0:
                source.release(f)

    try:
        while pending or opened:
            while len(running) < depth:
                if not feeding:
                    if not pending or (opened and not source.can_stage(pending[0].needs)):
                        break  # nothing left, or its source shards would overflow staging: wait for releases
                    # enough shards left to keep every worker busy, or one its sha256 bounds however split
                    whole = len(pending) >= executor.slots or copies_mostly(pending[0])
                    unit = pending.popleft()
                    vetted = {f: source.fetch_vetted(f) for f in unit.needs}
                    paths = {f: str(path) for f, (path, _) in vetted.items()}
                    shard = OpenShard(unit, out_dir, paths, part_bytes, hash_here, whole=whole,
                                      identities={f: ident for f, (_, ident) in vetted.items()},
                                      taper=0 if pending else executor.slots,  # the run's last shard
                                      take_turns=take_turns)
                    opened.append(shard)
                    if shard.jobs:
                        feeding.append(shard)
                    else:
                        completing(shard)
                    continue
                shard = feeding[0]
                job = shard.jobs.popleft()
                if not shard.jobs:
                    feeding.popleft()
                job["hash_inputs"] = sorted(unhashed.intersection(job["needs"]))
                unhashed.difference_update(job["hash_inputs"])
                running[executor.submit(job, shard.paths, str(out_dir))] = (shard, job)
            finished, _ = wait([*running, *live], return_when=FIRST_COMPLETED)
            for fut in finished:
                if fut in running:
                    shard, job = running.pop(fut)
                    res = fut.result()
                    on_inputs(res.get("inputs") or {})
                    if shard.whole:  # its worker hashed and renamed it
                        complete(shard, res["size"], res["sha256"])
                        continue
                    shard.assembly.written(*job["span"])
                    shard.parts_left -= 1
                    if not shard.parts_left:
                        completing(shard)
                elif fut in live:
                    shard = live.pop(fut)
                    res = fut.result()
                    complete(shard, *((res["size"], res["sha256"]) if isinstance(res, dict) else res))
        ok = True
    finally:
        if not ok:
            for shard in opened:
                shard.assembly.abort()
