"""Sizing a conversion before it runs (``kimi-quant plan``): disk, memory and wall time.

The time estimate is arithmetic over the plan with rates measured on this machine: the workers'
own code (``convert_unit``) converts a sample shard, one small unit per scheme (``measure_rates``,
~1 s with the kernels cached), so a rate holds everything a worker spends on a byte: reading it
from the page cache, quantizing or copying it, writing and hashing the output, Python around it.
Rates are CPU seconds of one core per input byte. The scaling model (``wall_seconds``), the one
docs/distributed.md uses for a 64-core node and for N Ray nodes:

    T = start-up + max(C / N, D / L)

C: core-seconds (input bytes x the rate of their scheme); N: workers that run at once (cores of
this machine for the local executor, the cluster's for Ray; since shards are split into parts, no
longer capped by the number of output shards); D / L: a hub source's bytes over the download link
(``link_bps``, when given: the driver downloads for every worker, so with enough nodes the link is
the limit). The rates are stored (``rates_path``) and reused until the tool version, the CPU or the
measured code (``code_fingerprint``) changes; ``plan --remeasure`` takes them again.

Not in the estimate: reading a source that is not in the page cache (a disk slower than the
codecs bounds the run instead), and the few per cent that splitting the last shards costs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import __version__
from .cache import cache_dir, cpu_id, cpu_key
from .plan import Plan
from .recipe.recipe import FLOAT

log = logging.getLogger(__name__)

#: the sample each codec quantizes: a real expert row length (K = 3584), 1024 rows (~7 MB of BF16)
SAMPLE_SHAPE = (1024, 3584)
#: the driver's own memory (imports, the plan, the journal) and the fixed buffers of a worker
DRIVER_BYTES = 300 * 1024**2
WORKER_FIXED_BYTES = 64 * 1024**2
#: starting the driver and its workers, the split shard's overhead, and writing the metadata, with the kernels cached
STARTUP_S = 0.5
#: building the compiled kernels (``quant.aot``; the first run after installing or upgrading)
COMPILE_S = 20.0


def _cpu_name() -> str:
    """The CPU's model name (for people: ``cpu_key`` is what the stored rates are checked against)."""
    names = [ln.split(":", 1)[1].strip() for ln in cpu_id().splitlines() if ln.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


@dataclass
class Rates:
    """CPU seconds of one core per BF16 input byte, measured on this machine, per scheme (FLOAT too):
    everything a worker does for a tensor (map it from the page cache, quantize or copy it, write
    the output, sha256 it for the journal, Python around it)."""

    per_byte: dict[str, float]
    cpu: str  # the model name, for people; ``cpu_key`` decides whether the rates still hold
    tool_version: str
    measured_at: str
    code: str = ""  # ``code_fingerprint()`` of the code measured
    cpu_key: str = ""  # ``cache.cpu_key()``: model name and feature flags
    where: str = ""  # "measured now" or the file they were read from (not stored)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("where")
        return d


def code_fingerprint() -> str:
    """BLAKE2b of the sources whose speed the rates measure (codecs, kernels, the unit, the writers): a
    development install whose kernels changed re-measures, as a new version does."""
    import hashlib

    root = Path(__file__).resolve().parent
    h = hashlib.blake2b(digest_size=8)
    for f in sorted([*(root / "quant").glob("*.py"), root / "executor" / "unit.py", *(root / "write").glob("*.py")]):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _best_cpu_times(fns: dict, rounds: int = 3) -> dict:
    """Per key, the best of ``rounds`` runs of its function in CPU seconds of this thread (robust when
    other work time-shares the cores). The rounds go through every function in turn, so a burst of
    other work (a compile, a second job on the other hyperthread of a core) that slows this thread's
    CPU time too spoils one sample of each rather than every sample of one."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for key, fn in fns.items():
            t = time.thread_time()
            fn()
            best[key] = min(best[key], time.thread_time() - t)
    return {key: max(v, 1e-9) for key, v in best.items()}


def measure_rates() -> Rates:
    """Convert a sample shard with the workers' own code (``convert_unit``), one unit per scheme:
    two seeded BF16 matrices of SAMPLE_SHAPE each, read from a file in the page cache and written to
    a temporary directory, and time it."""
    from .dtypes import f32_to_bf16
    from .executor.unit import convert_unit
    from .plan import TensorPlan, UnitPlan, output_tensors
    from .quant import REGISTRY, get_codec, warmup
    from .source.compressed import MXFP4
    from .write import ShardWriter

    warmup()  # compiles on a cold numba cache (not part of any rate)
    rng = np.random.default_rng(0)
    schemes = [FLOAT, *sorted(REGISTRY)]
    with tempfile.TemporaryDirectory(prefix="kq-rates-") as d:
        src = Path(d) / "sample.safetensors"
        names = [(s, f"{s}.{i}.weight") for s in schemes for i in range(2)]
        samples = {n: f32_to_bf16((0.02 * rng.standard_normal(SAMPLE_SHAPE)).astype(np.float32)) for _, n in names}
        # packed MXFP4 sources (a released checkpoint's experts): the repack, and int4 from the decoded values
        packed = {key: [f"{key}.{i}" for i in range(2)] for key in PACKED_RATE_KEYS}
        mx = get_codec("W4A8_MXFP")
        parts: dict[str, np.ndarray] = {}
        weights = list(samples.values())
        for i, p in enumerate(p for ps in packed.values() for p in ps):
            out = mx.quantize_bf16(weights[i])
            parts[f"{p}.weight_packed"], parts[f"{p}.weight_scale"] = out["weight"], out["weight_scale"]
        writer = ShardWriter(src, [(n, "BF16", SAMPLE_SHAPE) for _, n in names]
                             + [(n, "U8", a.shape) for n, a in parts.items()])
        for n, a in [*samples.items(), *parts.items()]:
            writer.write(n, a)
        writer.commit()
        units = {}
        for scheme in schemes:
            codec = REGISTRY.get(scheme)
            matmul = "down" if codec is not None and codec.check(SAMPLE_SHAPE, "down") is None else None
            units[scheme] = UnitPlan(f"{scheme}.safetensors", [
                TensorPlan(n, src.name, "BF16", list(SAMPLE_SHAPE), scheme, matmul,
                           output_tensors(n, "BF16", list(SAMPLE_SHAPE), scheme, matmul)) for s, n in names if s == scheme])
        for key, prefixes in packed.items():
            scheme, group = PACKED_RATE_KEYS[key]
            units[key] = UnitPlan(f"{scheme}-mxfp4.safetensors", [
                TensorPlan(f"{p}.weight", src.name, MXFP4, list(SAMPLE_SHAPE), scheme, "down",
                           output_tensors(f"{p}.weight", "BF16", list(SAMPLE_SHAPE), scheme, "down", group), group,
                           [[f"{p}.weight_packed", src.name], [f"{p}.weight_scale", src.name]]) for p in prefixes])
        seconds = _best_cpu_times({scheme: functools.partial(convert_unit, unit, {src.name: str(src)}, d)
                                   for scheme, unit in units.items()})
        per_byte = {scheme: seconds[scheme] / unit.in_bytes for scheme, unit in units.items()}
    return Rates(per_byte=per_byte, cpu=_cpu_name(), cpu_key=cpu_key(), tool_version=__version__,
                 measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), code=code_fingerprint(),
                 where="measured now")


#: rates measured from packed MXFP4 sources: key -> (output scheme, int4 group size)
PACKED_RATE_KEYS = {"W4A8_MXFP<MXFP4": ("W4A8_MXFP", 0), "W4A8_DYNAMIC<MXFP4": ("W4A8_DYNAMIC", 32)}


def packed_rate_key(scheme: str) -> str:
    return f"{scheme}<MXFP4"


def rates_path() -> Path:
    return cache_dir() / "codec_rates.json"


def _rates_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _stored_rates(path: Path) -> Rates | None:
    """The rates stored at ``path`` if they are whole, of this file's own digest, and plausible
    (positive finite seconds per byte, strings where strings go), else None. The cache is private
    (``cache.private_dir``), so a file that fails is damaged: it is measured again, with one warning."""
    from .cache import read_private

    data = read_private(path)
    if data is None:
        if os.path.lexists(path):
            log.warning("kimi-quant: warning: %s is not a plain file of yours (or is too large): measuring the "
                        "codec rates again", path)
        return None
    try:
        d = json.loads(data.decode("utf-8"))
        if not isinstance(d, dict):
            raise ValueError("not an object")
        recorded = d.pop("sha256", None)
        if recorded != _rates_digest(d):
            raise ValueError("its digest does not match its content")
        r = Rates(**d)
        if not all(isinstance(getattr(r, f), str) for f in ("cpu", "tool_version", "measured_at", "code", "cpu_key")):
            raise ValueError("a field is not a string")
        if not isinstance(r.per_byte, dict) or not r.per_byte or not all(
                isinstance(k, str) and type(v) is float and math.isfinite(v) and 0 < v < 1
                for k, v in r.per_byte.items()):
            raise ValueError("per_byte is not seconds per byte")
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else " ".join(str(e).split())[:80]
        log.warning("kimi-quant: warning: %s is damaged (%s): measuring the codec rates again", path, why)
        return None
    return r


def load_rates(remeasure: bool = False, on_measure=None) -> Rates:
    """The stored rates of this machine and tool version, else measured now (and stored; ``on_measure``
    is called first, to say so)."""
    path = rates_path()
    if not remeasure:
        r = _stored_rates(path)
        if (r is not None and r.tool_version == __version__ and r.cpu_key == cpu_key()
                and r.code == code_fingerprint()):
            r.where = str(path)
            return r
    if on_measure is not None:
        on_measure()
    r = measure_rates()
    try:
        from .cache import write_private

        body = r.to_json()
        write_private(path, (json.dumps({**body, "sha256": _rates_digest(body)}, indent=2) + "\n").encode())
    except OSError:
        pass  # a read-only cache costs a measurement next time, nothing else
    return r


def wall_seconds(core_s: float, parallel: int, download_bytes: int = 0, link_bps: float | None = None) -> float:
    """The scaling model: start-up + max(core-seconds over the workers, download over the link)."""
    compute = core_s / max(parallel, 1)
    download = download_bytes / link_bps if download_bytes and link_bps else 0.0
    return STARTUP_S + max(compute, download)


def tensor_core_seconds(t, rates: Rates) -> float:
    """CPU seconds of one core for source tensor ``t`` (a TensorPlan). A packed MXFP4 tensor has rates
    of its own (a repack moves bytes; int4 decodes first); a scheme measured only from BF16 is taken at
    its rate per element."""
    slowest = max(rates.per_byte.values())
    if not t.packed:
        return t.in_bytes * rates.per_byte.get(t.scheme, slowest)
    key = packed_rate_key(t.scheme)
    if key in rates.per_byte:
        return t.in_bytes * rates.per_byte[key]
    return 2 * math.prod(t.shape) * rates.per_byte.get(t.scheme, slowest)  # as many elements of BF16


def unit_core_seconds(plan: Plan, rates: Rates) -> list[float]:
    """CPU seconds of one core per output shard."""
    return [sum(tensor_core_seconds(t, rates) for t in u.tensors) for u in plan.units]


def calibrate_seconds(plan: Plan, rates: Rates, workers: int) -> float | None:
    """Wall seconds ``convert --calibrate`` adds, or None while that option does not exist.

    Hook for the calibration feature: return its estimate here and ``plan`` prints it as a line
    of its own and adds it to the total (``size_job``)."""
    return None


def kernels_cached(state: str | None = None) -> bool | None:
    """Whether the kernels are ready to load: compiled ahead of time (``quant.aot``), or, where that
    build failed, in numba's cache: in NUMBA_CACHE_DIR when set, else next to their source (None:
    cannot tell, the source directory is read-only and numba uses a per-user directory).
    ``state``: ``aot.state()`` when the caller has it already."""
    from .quant import aot

    state = state or aot.state()
    if state in ("built", "missing"):
        return state == "built"
    if os.environ.get("NUMBA_CACHE_DIR"):
        root = Path(os.environ["NUMBA_CACHE_DIR"])
        return any("kimi_quant" in str(p.parent) for p in root.rglob("kernels.*.nbi")) if root.is_dir() else False
    quant = Path(__file__).parent / "quant"
    if not os.access(quant, os.W_OK):
        return None
    return any((quant / "__pycache__").glob("kernels.*.nbi"))


def kernels_build(state: str | None = None) -> dict:
    """Which kernels this machine's workers run: {"build": "compiled" | "jit" | "to build", "why": the
    reason a compiled build failed, "retry": the file to delete to try it again}. ``state``: as above."""
    from .quant import aot

    state = state or aot.state()
    if state in ("built", "missing"):
        return {"build": "compiled" if state == "built" else "to build"}
    if state == "untrusted":
        return {"build": "jit", "why": "group or others may write the module file, so it is not loaded",
                "retry": str(aot.module_path())}
    try:
        why = aot.failed_path().read_text().strip()
    except OSError:
        why = ""
    return {"build": "jit", "why": why, "retry": str(aot.failed_path())}


def size_job(plan: Plan, rates: Rates | None, *, workers: int, executor: str = "local", hub: bool = False,
             max_disk: int | None = None, input_sizes: dict[str, int] | None = None,
             link_bps: float | None = None) -> dict:
    """Disk, memory and time of converting ``plan`` (all numbers; ``plan`` prints them, --json stores them).

    ``hub``: the source is staged shard by shard (``max_disk`` bytes at most; without it the staging
    default of two shards, or the shards of the largest output shard when that is more). ``link_bps``:
    the download link the time assumes for a hub source (``wall_seconds``)."""
    sizes = input_sizes or plan.inputs
    needs = [sum(sizes.get(f, 0) for f in u.needs) for u in plan.units]
    min_window = max(needs, default=0)
    staging = None
    if hub:
        if max_disk is not None:
            staging = min(max(max_disk, min_window), sum(sizes.values()))
        else:
            staging = max(min_window, sum(sorted(sizes.values())[-2:]))
    biggest = max((t.in_bytes + t.out_bytes for t in plan.tensors() if t.scheme != FLOAT), default=0)
    cores = os.cpu_count() or 1
    # shards are split into parts when fewer are left than workers: every worker works at any shard size
    # (only a checkpoint with fewer quantized tensors than workers leaves some idle)
    tensors = sum(1 for _ in plan.tensors())
    parallel = max(1, min(workers, tensors or 1, cores if executor == "local" else workers))
    per_worker = biggest + WORKER_FIXED_BYTES
    from .quant import aot

    kernel_state = aot.state()  # hashes the kernel sources: once
    job = {
        "in_bytes": plan.in_bytes, "out_bytes": plan.out_bytes, "units": len(plan.units),
        "disk_output_bytes": plan.out_bytes,
        "disk_staging_bytes": staging,
        "disk_needed_bytes": plan.out_bytes + (staging or 0),
        "min_max_disk_bytes": min_window if hub else None,
        "max_disk_too_small": bool(hub and max_disk is not None and max_disk < min_window),
        "workers": workers, "executor": executor, "parallel": parallel,
        "memory_per_worker_bytes": per_worker,
        # local: the driver and its workers on this machine; Ray: the driver here, each task where Ray puts it
        "memory_peak_bytes": DRIVER_BYTES + (workers * per_worker if executor == "local" else 0),
        "download_bytes": sum(sizes.values()) if hub else 0,
        "kernels": kernels_build(kernel_state),
    }
    if rates is not None:
        per_unit = unit_core_seconds(plan, rates)
        core_s = sum(per_unit)
        cached = kernels_cached(kernel_state)
        compute = core_s / parallel
        download = job["download_bytes"] / link_bps if job["download_bytes"] and link_bps else 0.0
        calib = calibrate_seconds(plan, rates, workers)
        job.update({
            "core_seconds": round(core_s, 3),
            "wall_seconds": round(wall_seconds(core_s, parallel, job["download_bytes"], link_bps) + (calib or 0.0), 3),
            "limit": "download" if download > compute else "cpu",
            "link_gbps": link_bps / 1e9 if link_bps else None,
            "compile_seconds": 0.0 if cached or executor == "ray" else COMPILE_S if cached is False else None,
            "calibrate_seconds": calib,
            "rate_gbps": round(plan.in_bytes / max(compute, 1e-9) / 1e9, 3),
            "rates": {**rates.to_json(), "from": rates.where},
        })
    return job
