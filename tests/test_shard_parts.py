"""Shards written in parts by several workers: the same bytes as one streaming writer, any split, any order.

The reference is ``convert_unit``: one process writes a whole shard through ``ShardWriter``, front to
back, hashing as it goes (how every shard was written before shards were split into parts).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest

from kimi_quant.convert import ConvertOptions, build_plan, convert
from kimi_quant.errors import KimiQuantError
from kimi_quant.executor.shards import split
from kimi_quant.executor.unit import convert_unit
from kimi_quant.synth import synth
from kimi_quant.plan import DEFAULT_MAX_SHARD_SIZE
from kimi_quant.source import open_source
from kimi_quant.write import PartWriter, ShardAssembly, ShardWriter

JOURNAL = "kimi_quant_journal.jsonl"


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return synth("tiny", tmp_path_factory.mktemp("parts-src") / "src", random_weights=True)


def streamed(src: Path, target: str, shard: int, out: Path) -> dict[str, str]:
    """sha256 of each output shard as one streaming writer makes it."""
    out.mkdir(parents=True)
    source = open_source(str(src))
    try:
        plan = build_plan(source, target, max_shard_size=shard)
        res = [convert_unit(u.to_json(), {f: str(source.fetch(f)) for f in u.needs}, str(out)) for u in plan.units]
    finally:
        source.close()
    shas = {r["file"]: r["sha256"] for r in res}
    assert shas == {f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in shas}
    return shas


def shards(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("quant_model_weights-*"))}


@pytest.mark.parametrize("target", ["a3", "950dt"])
@pytest.mark.parametrize("shard", [1_000_000, DEFAULT_MAX_SHARD_SIZE], ids=["tiny-shards", "default-shards"])
def test_parts_make_the_streamed_bytes(src, tmp_path, target, shard):
    ref = streamed(src, target, shard, tmp_path / "ref")
    outs = {}
    for workers, part in ((1, 1), (2, 1), (2, 300_000), (2, None)):  # every tensor its own part ... the default
        out = tmp_path / f"w{workers}-p{part}"
        opts = ConvertOptions(target=target, output=out, workers=workers, quiet=True, max_shard_size=shard)
        if part:
            opts.part_bytes = part
        convert(str(src), opts)
        assert shards(out) == ref, (workers, part)
        units = [json.loads(ln) for ln in (out / JOURNAL).read_text().splitlines()]
        units = [e for e in units if e["kind"] == "unit"]
        assert sorted(e["file"] for e in units) == sorted(ref)  # one record per shard, with its sha256
        assert {e["file"]: e["sha256"] for e in units} == ref
        assert not list(out.glob("*.partial"))
        outs[(workers, part)] = {p.name: p.read_bytes() for p in out.iterdir() if p.name != JOURNAL}
    first = next(iter(outs.values()))
    assert all(o == first for o in outs.values())  # index, description, provenance too
    if shard == DEFAULT_MAX_SHARD_SIZE:
        assert len(ref) == 1  # one shard, yet two workers wrote it


def test_shards_finished_by_a_worker_are_the_same(src, tmp_path, monkeypatch):
    """Executors whose workers may be on other nodes (Ray) have a worker hash and rename each shard."""
    from kimi_quant.executor.local import LocalExecutor

    ref = streamed(src, "a3", 1_000_000, tmp_path / "ref")
    monkeypatch.setattr(LocalExecutor, "remote", True, raising=False)
    for workers in (1, 2):
        out = tmp_path / f"remote-w{workers}"
        convert(str(src), ConvertOptions(target="a3", output=out, workers=workers, quiet=True,
                                         max_shard_size=1_000_000, part_bytes=200_000))
        assert shards(out) == ref
        assert not list(out.glob("*.partial"))


def test_split_keeps_order_and_covers_every_tensor(src):
    source = open_source(str(src))
    try:
        (unit,) = build_plan(source, "a3").units
    finally:
        source.close()
    for part in (1, 50_000, 10**6, 10**12):
        parts = split(unit.tensors, part)
        assert [t for p in parts for t in p] == unit.tensors
        assert all(p for p in parts)
        assert all(sum(t.in_bytes for t in p[:-1]) < part for p in parts)  # closed as soon as it is full
    assert len(split(unit.tensors, 1)) == len(unit.tensors)
    assert split([], 1) == []



@pytest.mark.parametrize("workers", [1, 2, 8])
def test_the_last_shard_ends_on_smaller_parts(workers):
    """``taper``: the parts of a run's last shard shrink towards its end (each closes at its 1/(2 workers)
    share of the input left when it opened, never below part_bytes / 8), in order and covering every tensor."""
    from kimi_quant.plan import TensorPlan

    sizes = [7 * 2**20] * 60 + [24 * 2**20] * 4 + [2**20] * 10  # expert-like, then big float, then small
    tensors = [TensorPlan(name=f"t{i}", file="f", dtype="BF16", shape=[n // 2], scheme="FLOAT", matmul=None, outputs=[])
               for i, n in enumerate(sizes)]
    part = 96 * 2**20
    parts = split(tensors, part, taper=workers)
    assert [t for p in parts for t in p] == tensors
    left = sum(sizes)
    for p in parts:
        limit = min(part, max(part // 8, left // (2 * workers)))
        assert sum(t.in_bytes for t in p[:-1]) < limit  # closed as soon as it reached its limit
        left -= sum(t.in_bytes for t in p)
    plain = split(tensors, part)
    assert len(parts) > len(plain)
    assert sum(t.in_bytes for t in parts[-1]) < sum(t.in_bytes for t in plain[-1])
    assert split(tensors, part, taper=0) == plain

ENTRIES = [("a", "U8", (5,)), ("b", "BF16", (3, 4)), ("c", "F32", (7,)), ("d", "I8", (0,)), ("e", "U8", (13,))]


def _data(rng):
    return {"a": rng.integers(0, 255, 5, dtype=np.uint8), "b": rng.integers(0, 2**16, (3, 4), dtype=np.uint16),
            "c": rng.standard_normal(7).astype(np.float32), "d": np.zeros(0, np.int8),
            "e": rng.integers(0, 255, 13, dtype=np.uint8)}


def _reference(tmp_path, seed: int):
    """ENTRIES filled with seeded data, and (size, sha256) of the streaming writer's ref.safetensors."""
    data = _data(np.random.default_rng(seed))
    ref = ShardWriter(tmp_path / "ref.safetensors", ENTRIES)
    for name, _, _ in ENTRIES:
        ref.write(name, data[name])
    return data, ref.commit()


def test_parts_in_any_order_equal_one_stream(tmp_path):
    data, (size, sha) = _reference(tmp_path, 0)
    for trial in range(5):
        path = tmp_path / f"p{trial}.safetensors"
        asm = ShardAssembly(path, ENTRIES)
        assert not path.exists() and asm.tmp.exists() and asm.tmp.name.endswith(".partial")
        sizes = {n: int(np.prod(s)) * {"U8": 1, "I8": 1, "BF16": 2, "F32": 4}[d] for n, d, s in ENTRIES}
        order = [n for n, _, _ in ENTRIES]
        random.Random(trial).shuffle(order)
        w = PartWriter(asm.tmp, asm.offsets, {n: (d, s) for n, d, s in ENTRIES}, path.name)
        for i, name in enumerate(order):
            w.write(name, data[name])
            if i < len(order) - 1:
                asm.written(asm.offsets[name], asm.offsets[name] + sizes[name])
                assert not path.exists()  # nothing looks complete while a part is missing
        w.close()
        asm.written(asm.offsets[order[-1]], asm.offsets[order[-1]] + sizes[order[-1]])
        assert asm.done.result(timeout=30) == (size, sha)
        assert path.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
        assert not asm.tmp.exists()


def test_local_part_writers_take_turns_on_the_file(tmp_path, monkeypatch):
    """Writers on one node write into the shared file one at a time (flock). While another has the
    file, a writer keeps what ``write`` gave it (up to HOLD_BYTES) instead of waiting, and writes it
    at its next turn; ``close`` waits for that turn; after an error what it holds is dropped; where
    the file system has no such lock it writes without turns."""
    import kimi_quant.write.shard_parts as shard_parts

    data, _ = _reference(tmp_path, 3)
    path = tmp_path / "t.safetensors"
    asm = ShardAssembly(path, ENTRIES, hash_here=False)
    entries = {n: (d, s) for n, d, s in ENTRIES}
    other = os.open(asm.tmp, os.O_RDWR)  # another worker's descriptor, holding its turn

    def in_file(name):
        return os.pread(other, data[name].nbytes, asm.offsets[name]) == data[name].tobytes()

    def blocked(call) -> threading.Thread:
        t = threading.Thread(target=call, daemon=True)
        t.start()
        t.join(0.3)
        return t

    fcntl.flock(other, fcntl.LOCK_EX)
    w = PartWriter(asm.tmp, asm.offsets, entries, path.name, take_turns=True)
    try:
        t = blocked(lambda: w.write("a", data["a"]))  # kept: the call returns at once
        assert not t.is_alive() and not in_file("a")
        monkeypatch.setattr(shard_parts, "HOLD_BYTES", data["a"].nbytes)
        t = blocked(lambda: w.write("b", data["b"]))  # over what it may keep: waits for its turn
        assert t.is_alive() and not in_file("a") and not in_file("b")
    finally:
        fcntl.flock(other, fcntl.LOCK_UN)
    t.join(10)
    assert not t.is_alive() and in_file("a") and in_file("b")
    monkeypatch.setattr(shard_parts, "HOLD_BYTES", 1 << 30)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the writer let go of its turn
    try:
        w.write("c", data["c"])
        t = blocked(w.close)  # close writes what it holds: at its turn
        assert t.is_alive() and not in_file("c")
    finally:
        fcntl.flock(other, fcntl.LOCK_UN)
    t.join(10)
    assert not t.is_alive() and in_file("c")

    fcntl.flock(other, fcntl.LOCK_EX)
    w = PartWriter(asm.tmp, asm.offsets, entries, path.name, take_turns=True)
    w.write("e", data["e"])
    w.close(write_held=False)  # after an error: dropped, and no wait
    fcntl.flock(other, fcntl.LOCK_UN)
    assert not in_file("e")

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    w = PartWriter(asm.tmp, asm.offsets, entries, path.name, take_turns=True)
    w.write("e", data["e"])  # no turns on this file system: written all the same
    assert in_file("e")
    w.close()
    os.close(other)
    asm.abort()


def test_a_full_disk_while_writing_what_was_kept_is_one_clean_error(tmp_path, monkeypatch):
    """Kept tensors written at the end of a part into a full disk: the disk-full error, the
    descriptor closed all the same."""
    import kimi_quant.write.shard_parts as shard_parts

    data, _ = _reference(tmp_path, 4)
    path = tmp_path / "f.safetensors"
    asm = ShardAssembly(path, ENTRIES, hash_here=False)
    w = PartWriter(asm.tmp, asm.offsets, {n: (d, s) for n, d, s in ENTRIES}, path.name, take_turns=True)
    monkeypatch.setattr(shard_parts, "HOLD_BYTES", 1 << 30)
    other = os.open(asm.tmp, os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX)
    w.write("e", data["e"])  # kept: another writer has the file
    fcntl.flock(other, fcntl.LOCK_UN)
    os.close(other)

    def full(fd, buf, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shard_parts, "_pwrite_all", full)
    with pytest.raises(KimiQuantError, match="(?i)no space left on device"):
        w.close()
    assert w._fd is None
    asm.abort()


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - overlay overlay rw
30 22 0:25 / /dev/shm rw,nosuid shared:5 - tmpfs tmpfs rw
41 22 0:40 / /mnt/nfs rw,relatime shared:9 - nfs4 server:/export rw,vers=4.2
42 41 8:17 / /mnt/nfs/scratch rw,relatime shared:10 - ext4 /dev/sdb1 rw
43 22 8:33 / /mnt/my\\040disk rw,relatime shared:11 - xfs /dev/sdc1 rw
44 22 0:50 / /data rw shared:12 - ext4 /dev/sdd1 rw
45 22 0:51 / /data rw shared:13 - lustre 10.0.0.1@tcp:/fs rw
"""


@pytest.mark.parametrize("path, local", [
    ("/dev/shm/out", True), ("/mnt/nfs/out", False), ("/mnt/nfs/scratch/out", True), ("/mnt/nfsx", True),
    ("/mnt/my disk/out", True), ("/data/out", False), ("/", True)])
def test_turns_only_where_flock_stays_on_the_node(path, local):
    """Writers take turns (flock) only on a local file system: the last mount on the longest mount
    point above the path decides (a later mount on /data hides the ext4 under it; /mnt/nfsx is not
    under /mnt/nfs; an escaped space in a mount point is read as a space)."""
    from kimi_quant.write import on_local_file_system

    assert on_local_file_system(path, MOUNTINFO) is local
    assert on_local_file_system(path, "") is False  # nothing known: no turns


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm here")
def test_the_real_mount_table_is_read():
    from kimi_quant.write import on_local_file_system

    assert on_local_file_system("/dev/shm") is True  # tmpfs (shm) on any Linux with /dev/shm
    assert on_local_file_system("/proc/self") is False  # proc


def test_abort_removes_the_file_and_a_late_worker_stops(tmp_path):
    path = tmp_path / "x.safetensors"
    asm = ShardAssembly(path, ENTRIES)
    w = PartWriter(asm.tmp, asm.offsets, {n: (d, s) for n, d, s in ENTRIES}, path.name)
    w.write("a", np.arange(5, dtype=np.uint8))
    asm.written(asm.offsets["a"], asm.offsets["a"] + 5)
    asm.abort()
    w.close()
    assert list(tmp_path.iterdir()) == []  # neither the final name nor the .partial
    assert not asm.done.done()
    with pytest.raises(KimiQuantError, match="is gone: the run converting x.safetensors was stopped"):
        PartWriter(asm.tmp, asm.offsets, {}, path.name)
    # a resumed run's file has another name: a worker of the stopped run cannot write into it
    again = ShardAssembly(path, ENTRIES)
    assert again.tmp != asm.tmp
    again.abort()


def test_a_whole_shard_writer_of_a_stopped_run_leaves_nothing(tmp_path):
    """The flake this fixes: a Ray task force-killed (or still running) after the driver aborted used to
    leave its own .partial. Workers create no file: the driver's removal is final, even mid-write."""
    path = tmp_path / "w.safetensors"
    asm = ShardAssembly(path, ENTRIES, hash_here=False)
    data = _data(np.random.default_rng(2))
    w = PartWriter(asm.tmp, asm.offsets, {n: (d, s) for n, d, s in ENTRIES}, path.name, whole=True)
    w.write("a", data["a"])
    asm.abort()  # the driver stops the run while the worker writes
    for name in ("b", "c", "d", "e"):
        w.write(name, data[name])  # into the removed file
    with pytest.raises(KimiQuantError, match="is gone"):
        w.commit()
    assert list(tmp_path.iterdir()) == []


def test_a_whole_shard_job_hashes_as_it_writes(tmp_path):
    """A shard written by one job (enough shards left for every worker) is hashed front to back by
    its writer and renamed by it: the bytes and sha256 of the streaming writer, nothing read back."""
    data, (size, sha) = _reference(tmp_path, 1)
    path = tmp_path / "w.safetensors"
    asm = ShardAssembly(path, ENTRIES, hash_here=False)
    w = PartWriter(asm.tmp, asm.offsets, {n: (d, s) for n, d, s in ENTRIES}, path.name, whole=True)
    for name, _, _ in ENTRIES:
        w.write(name, data[name])
    assert w.commit() == (size, sha)
    assert path.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert not asm.tmp.exists()
    # out of order it cannot hash: refused, never a wrong sha256
    asm = ShardAssembly(tmp_path / "o.safetensors", ENTRIES, hash_here=False)
    w = PartWriter(asm.tmp, asm.offsets, {n: (d, s) for n, d, s in ENTRIES}, "o.safetensors", whole=True)
    with pytest.raises(RuntimeError, match="expected"):
        w.write("b", data["b"])
    w.close()
    asm.abort()


@pytest.fixture
def shard_kinds(monkeypatch) -> list[bool]:
    """Whether each shard job the scheduler opens is whole (True) or split into parts (False), in order."""
    from kimi_quant.executor import shards as sched

    kinds = []
    real = sched.OpenShard

    def spy(*a, **kw):
        kinds.append(kw.get("whole", False))
        return real(*a, **kw)

    monkeypatch.setattr(sched, "OpenShard", spy)
    return kinds


def test_many_shards_run_whole_and_only_the_tail_is_split(src, tmp_path, shard_kinds):
    kinds = shard_kinds
    shard = 700_000  # the last shard quantizes most of its bytes (at 1 MB it holds only copied FLOAT tensors)
    ref = streamed(src, "a3", shard, tmp_path / "ref")
    out = tmp_path / "out"
    convert(str(src), ConvertOptions(target="a3", output=out, workers=2, quiet=True, max_shard_size=shard))
    assert shards(out) == ref
    assert len(kinds) == len(ref) >= 3
    assert kinds == [True] * (len(ref) - 1) + [False]  # with 2 workers only the last shard is split
    kinds.clear()
    out1 = tmp_path / "one-worker"
    convert(str(src), ConvertOptions(target="a3", output=out1, workers=1, quiet=True, max_shard_size=shard))
    assert shards(out1) == ref and all(kinds)  # one worker never splits: no cost over the streaming writer


def test_a_shard_of_copied_bytes_is_one_job_whatever_is_left(tmp_path, shard_kinds):
    """950dt from the released layout copies the MXFP4 experts as they are: the shard's sha256, on one
    thread however split, bounds it, so even the run's last (here only) shard is one whole job, written
    on one core and hashed on another, with the streaming writer's bytes. A BF16 source's is split."""
    from kimi_quant.executor import shards as sched

    kinds = shard_kinds
    released = synth("tiny", tmp_path / "released", experts="mxfp4")
    bf16 = synth("tiny", tmp_path / "bf16")
    for src, whole in ((released, True), (bf16, False)):
        source = open_source(str(src))
        try:
            (unit,) = build_plan(source, "950dt").units
        finally:
            source.close()
        assert sched.copies_mostly(unit) is whole
        kinds.clear()
        out = tmp_path / f"out-{src.name}"
        convert(str(src), ConvertOptions(target="950dt", output=out, workers=2, quiet=True))
        assert kinds == [whole]
        assert shards(out) == streamed(src, "950dt", DEFAULT_MAX_SHARD_SIZE, tmp_path / f"ref-{src.name}")
        assert not list(out.glob("*.partial"))


def _vm_flags_of(m) -> list[str]:
    """The VmFlags of the mapping holding mmap ``m`` (/proc/self/smaps)."""
    view = np.frombuffer(m, np.uint8)
    addr = view.ctypes.data
    del view  # a live view would keep the mapping from closing
    flags, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
    return flags


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux /proc")
def test_the_hash_maps_the_shard_sequential_and_the_source_keeps_its_read_ahead(src, tmp_path):
    """The driver's hash thread maps the shard it just wrote MADV_SEQUENTIAL ("sr" in VmFlags): the kernel
    keeps no recency for those pages, and unmapping them no longer marks each one accessed under the LRU
    lock (~2% of a 950dt run's CPU). The source is mapped plainly: advised sequential, its faults read
    ahead in small folios and a conversion from a cold page cache took twice as long."""
    from kimi_quant.source.safetensors import SafetensorsReader
    from kimi_quant.write.shard_parts import _map_read_once

    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(256)) * 64)
    with open(path, "rb") as f, _map_read_once(f.fileno(), 256 * 64) as m:
        assert m[:3] == b"\x00\x01\x02" and len(m) == 256 * 64
        assert "sr" in _vm_flags_of(m)
    shard = sorted(Path(src).glob("*.safetensors"))[0]
    with SafetensorsReader(shard) as r:
        assert "sr" not in _vm_flags_of(r._mmap)
