#!/usr/bin/env python
"""Benchmark whole-CLI conversion against reading the same bytes, with peak memory.

For each target it runs `kimi-quant convert` as a subprocess on a `synth --preset bench`
checkpoint and reports, measured in the same run:
  * GB/s of BF16 input, and the ratio to a plain read of the same source bytes;
  * the rate of writing as many bytes as the output into a fresh file in the output folder (one thread): on
    a VM the host may back each freed page anew when it is written (free page reporting), and the output
    side of a conversion pays that too;
  * one core's sha256 rate, and the copy floor it implies (``copy_floor``: writing and hashing the output
    and mapping the source, without start-up or quantizing; a shard's digest runs on one thread);
  * the CPU cost of mapping the cached source into a process (``src_map_core_s_per_gb``): it depends on
    the folios the page cache holds it in, moved a 950dt run by ~0.5-1 core-s here, and ``--recache``
    resets it (drop the source's cache; the bench's first read brings it back);
  * peak RSS of the whole process tree (driver + workers, sampled every 20 ms) and of the largest process;
  * cores busy: CPU seconds of the whole process tree over the wall time (and the load average, since
    other work on the machine skews every number here), and ``steal_pct``: the share of the machine's
    CPU time a VM's host took back during the runs (the worst run), which skews them too;
  * with --double, the same on a checkpoint with twice the experts (memory must stay flat).
Optionally (--llm-compressor) runs llm-compressor's model_free_ptq on the same checkpoint when installed.

    python scripts/bench_convert.py --work /tmp/kq-bench --out /dev/shm/kq-bench [--experts 16] [--double]
        [--targets a3 950dt] [--max-shard-size 4GiB 128MiB] [--workers 1 2] [--warm-memory 16] [--recache]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def tree_pids(pid: int) -> list[int]:
    pids, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        pids.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                frontier += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return pids


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process so far (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def tree_rss(pids: list[int]) -> tuple[int, int]:
    """(sum, max) RSS in bytes over ``pids``."""
    total = biggest = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        kb = int(line.split()[1]) * 1024
                        total += kb
                        biggest = max(biggest, kb)
        except OSError:
            pass
    return total, biggest


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) ticks of all CPUs so far (/proc/stat; (0, 0) where there is none)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (v[7] if len(v) > 7 else 0), sum(v[:8])


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    ticks0 = cpu_ticks()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    peak_sum = peak_max = 0
    cpu: dict[int, float] = {}  # pid -> CPU seconds when last seen (a worker's last 20 ms are missed)
    while proc.poll() is None:
        pids = tree_pids(proc.pid)
        s, m = tree_rss(pids)
        peak_sum, peak_max = max(peak_sum, s), max(peak_max, m)
        for p in pids:
            c = cpu_seconds(p)
            if c is not None:
                cpu[p] = c
        time.sleep(0.02)
    seconds = time.perf_counter() - t0
    ticks1 = cpu_ticks()
    out = proc.stdout.read()
    if proc.returncode:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{out}")
    return {"seconds": seconds, "peak_rss_tree": peak_sum, "peak_rss_max": peak_max, "log": out,
            "cores_busy": sum(cpu.values()) / seconds,
            # CPU time the host took back from this VM meanwhile: what moves a run's time without the code
            "steal_pct": 100 * (ticks1[0] - ticks0[0]) / max(ticks1[1] - ticks0[1], 1)}


def read_gbps(src: Path) -> tuple[float, int]:
    """Throughput of reading every source shard byte (page cache as the conversion will see it)."""
    files = sorted(src.glob("*.safetensors"))
    buf = bytearray(64 << 20)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total / (time.perf_counter() - t0) / 1e9, total


def drop_cache(src: Path) -> None:
    """Drop the source's page cache: the read that follows (``read_gbps``) brings it back in large
    read-ahead folios (as a first run from disk leaves it), whatever the files' writer, earlier runs
    or memory pressure left there (see ``map_cost``)."""
    for f in sorted(src.glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def map_cost(src: Path) -> float:
    """CPU seconds per GB to map every page of the cached source into a process and unmap it again:
    what the workers' mmap reads pay besides the quantizing. It depends on how the page cache holds
    the source, not on this tool: 2 MiB folios (read ahead with a large window) map with one entry,
    single pages (read with readahead off, or split under memory pressure) with 512. On this VM it
    ranged over 0.01-0.17 core-s per GB, moving a 950dt run by ~0.5-1 core-s."""
    import mmap

    import numpy as np

    total, t0 = 0, time.process_time()
    for f in sorted(src.glob("*.safetensors")):
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
            pages = np.frombuffer(m, np.uint8)[::mmap.PAGESIZE]
            int(pages.sum())  # one byte of every page
            total += len(m)
            del pages
    return (time.process_time() - t0) / (total / 1e9)


def write_gbps(folder: Path, nbytes: int) -> tuple[float, float]:
    """Rate of writing ``nbytes`` into a new file in ``folder`` (then deleted), one thread, 16 MiB writes:
    what the output side of a conversion costs at least, beside quantizing. (GB/s of wall time, CPU
    seconds per GB: the second holds on a loaded machine.)"""
    buf = memoryview(bytearray(16 << 20))
    path = folder / f".kq-bench-write-{os.getpid()}"
    t0, cpu0 = time.perf_counter(), time.process_time()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[:min(left, len(buf))])
    finally:
        os.close(fd)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    path.unlink()
    return nbytes / seconds / 1e9, cpu / (nbytes / 1e9)


def sha256_gbps(nbytes: int = 256 << 20) -> float:
    """One core's sha256 rate (GB/s) over bytes already in memory, best of 3: what the journal's digest of
    every output byte costs at least (OpenSSL uses the SHA extensions where the CPU has them)."""
    import hashlib

    buf = memoryview(os.urandom(16 << 20))
    best = float("inf")
    for _ in range(3):
        h, t0 = hashlib.sha256(), time.process_time()
        for _ in range(nbytes // buf.nbytes):
            h.update(buf)
        best = min(best, time.process_time() - t0)
    return nbytes / best / 1e9


def copy_floor(in_bytes: int, out_bytes: int, largest_shard: int, sha_gbps: float, write_core_s: float,
               src_map: float, cores: int) -> dict:
    """The least a conversion that only moves bytes can take here, start-up and quantizing left out: map the
    source (``src_map``, core-s per GB), write the output (``write_core_s`` per GB) and sha256 it
    (``sha_gbps``; one thread per shard, so the largest shard's digest is a serial floor however many
    cores). ``sha256_share``: the digest's part of those core-seconds; ``gbps_ceiling``: GB/s of source
    bytes at that floor. From CPU times: a loaded machine moves them little."""
    hash_s = out_bytes / 1e9 / sha_gbps
    core_s = hash_s + out_bytes / 1e9 * write_core_s + in_bytes / 1e9 * src_map
    seconds = max(largest_shard / 1e9 / sha_gbps, core_s / cores)
    return {"floor_core_s": round(core_s, 2), "floor_s": round(seconds, 2), "sha256_share": round(hash_s / core_s, 2),
            "gbps_ceiling": round(in_bytes / seconds / 1e9, 2)}


def free_page_reporting() -> int | None:
    """The guest's free page reporting order when a virtio balloon reports freed pages to the host (whose
    next touch then faults in the host: slow fresh output pages), else None."""
    try:
        return int(Path("/sys/module/page_reporting/parameters/page_reporting_order").read_text())
    except (OSError, ValueError):
        return None


def precompile() -> None:
    """Byte-compile the installed kimi_quant, as pip does on install: in a sandbox that sets
    PYTHONDONTWRITEBYTECODE, every run would otherwise compile the package from source (~0.3 s of
    the driver and of the fork server before any work starts), which no installed copy pays."""
    import importlib.util

    spec = importlib.util.find_spec("kimi_quant")
    if spec is not None and spec.submodule_search_locations:
        subprocess.run([sys.executable, "-m", "compileall", "-q", *spec.submodule_search_locations],
                       check=False, stdout=subprocess.DEVNULL)


def warm_memory(gib: float) -> tuple[float, float]:
    """Touch ``gib`` GiB of fresh memory twice; the write rate (GB/s) of each pass.

    On a freshly booted VM (Firecracker here) the host backs guest memory only when it is first
    touched: a first pass ran at ~0.3 GB/s and a second at ~1.5 GB/s on the development VM. Every
    page an output lands in comes from that memory, so the first runs after a boot measure the
    hypervisor, not the code (and a tool measured later looks faster). One pass before measuring
    puts every tool on warm memory."""
    import numpy as np

    rates = []
    for _ in range(2):
        t0 = time.perf_counter()
        a = np.ones(int(gib * 2**30) // 8)
        rates.append(a.nbytes / (time.perf_counter() - t0) / 1e9)
        del a
    return rates[0], rates[1]


def synth(work: Path, experts: int, layout: str = "bf16") -> Path:
    """The bench checkpoint with ``experts`` routed experts per layer; ``layout`` "mxfp4": its routed
    experts as Kimi K3 is published (compressed-tensors mxfp4-pack-quantized), the same model."""
    src = work / f"bench-{layout}-e{experts}"
    if not (src / "config.json").exists():
        subprocess.run(["kimi-quant", "synth", "--preset", "bench", "--num-experts", str(experts), "--experts", layout,
                        "-o", str(src), "--overwrite"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return src


#: options per target for a released (MXFP4-expert) source: none (a3's default makes its experts int8)
RELEASED_TARGET_OPTIONS = {"a3": [], "950dt": []}


def bench(src: Path, work: Path, targets: list[str], workers: int | None, shard: str,
          extra: list[str] = (), repeat: int = 1, fresh_cache: bool = False) -> list[dict]:
    """Convert ``src`` for each target into ``work`` (put it on tmpfs to measure compute, not the disk),
    ``repeat`` times each: GB/s of the median run, and of the best. ``fresh_cache``: ``drop_cache`` first."""
    rows = []
    if fresh_cache:
        drop_cache(src)
    read_bw, nbytes = read_gbps(src)
    read_bw = max(read_bw, read_gbps(src)[0])  # the second read is warm (the first may come from disk)
    src_map = map_cost(src)
    for target in targets:
        out = work / f"out-{src.name}-{target}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = ["kimi-quant", "convert", str(src), "-t", target, "-o", str(out), "--max-shard-size", shard, "--quiet"]
        if workers:
            cmd += ["--workers", str(workers)]
        target_extra = RELEASED_TARGET_OPTIONS[target] if src.name.startswith("bench-mxfp4") else []
        cmd += list(extra) + target_extra
        runs = []
        for _ in range(repeat):
            shutil.rmtree(out, ignore_errors=True)
            runs.append(run_measured(cmd))
        out_sizes = [f.stat().st_size for f in out.glob("*.safetensors")]
        out_bytes = sum(out_sizes)
        shutil.rmtree(out, ignore_errors=True)
        write_bw, write_core_s = write_gbps(work, out_bytes)
        sha_bw = sha256_gbps()
        runs.sort(key=lambda r: r["seconds"])
        secs = [r["seconds"] for r in runs]
        median, best = secs[len(secs) // 2], secs[0]
        gbps = nbytes / median / 1e9
        rows.append({"source": src.name, "target": target, "shard": shard, "workers": workers,
                     "options": " ".join([*extra, *target_extra]), "in_gb": nbytes / 1e9,
                     "runs": repeat, "seconds": round(median, 2), "gbps": round(gbps, 3),
                     "gbps_best": round(nbytes / best / 1e9, 3), "read_gbps": round(read_bw, 2),
                     "ratio_to_read": round(gbps / read_bw, 3), "src_map_core_s_per_gb": round(src_map, 3),
                     "out_gb": round(out_bytes / 1e9, 3), "write_gbps": round(write_bw, 2),
                     "write_core_s_per_gb": round(write_core_s, 3), "sha256_gbps": round(sha_bw, 2),
                     **copy_floor(nbytes, out_bytes, max(out_sizes, default=0), sha_bw, write_core_s, src_map,
                                  workers or os.cpu_count() or 1),
                     "cores_busy": round(runs[len(runs) // 2]["cores_busy"], 2),
                     "steal_pct": round(max(r["steal_pct"] for r in runs), 1),
                     # CPU seconds per GB of input: what a loaded machine distorts least
                     "core_s_per_gb": round(min(r["cores_busy"] * r["seconds"] for r in runs) / (nbytes / 1e9), 3),
                     "loadavg_1m": round(os.getloadavg()[0], 2),
                     "peak_rss_tree_mb": max(r["peak_rss_tree"] for r in runs) >> 20,
                     "peak_rss_max_mb": max(r["peak_rss_max"] for r in runs) >> 20})
    return rows


#: What llm-compressor is asked to do for each of our schemes: the same storage where it has one.
#: a3: int4 per output channel, symmetric, packed 8 per int32 (``pack-quantized``), int8 per-token
#: dynamic activations (W4A8); W8A8 per channel in int8 (``int-quantized``). 950dt: its MXFP4 and
#: MXFP8 presets (E2M1 / E4M3 with an E8M0 scale per 32 weights, like ours).
LLMC_SCHEMES = {
    "W4A8_DYNAMIC": {"weights": dict(num_bits=4, type="int", strategy="channel", symmetric=True, dynamic=False),
                     "input_activations": dict(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True),
                     "format": "pack-quantized"},
    "W8A8_DYNAMIC": {"preset": "W8A8", "format": "int-quantized"},
    "W4A8_MXFP": {"preset": "MXFP4", "format": "mxfp4-pack-quantized"},
    "W8A8_MXFP8": {"preset": "MXFP8", "format": "mxfp8-quantized"},
}


def our_tensor_sets(src: Path, target: str) -> dict[str, list[str]]:
    """scheme -> module names (tensor name less ``.weight``) our plan quantizes with it."""
    from kimi_quant.convert import build_plan
    from kimi_quant.source import open_source

    source = open_source(str(src))
    try:
        plan = build_plan(source, target)
    finally:
        source.close()
    sets: dict[str, list[str]] = {}
    for u in plan.units:
        for t in u.tensors:
            if t.scheme != "FLOAT":
                sets.setdefault(t.scheme, []).append(t.name.removesuffix(".weight"))
    return sets


def inventory(out: Path) -> dict:
    """What a safetensors output holds: files, bytes, tensors, and tensors per dtype."""
    files = sorted(out.glob("*.safetensors"))
    by_dtype: dict[str, int] = {}
    n = 0
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, meta in header.items():
            if name != "__metadata__":
                by_dtype[meta["dtype"]] = by_dtype.get(meta["dtype"], 0) + 1
                n += 1
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "tensors": n,
            "by_dtype": dict(sorted(by_dtype.items()))}


def run_llmc(spec_file: str) -> None:
    """Run by the llm-compressor interpreter (``--llmc-spec``): model_free_ptq with one config group
    per scheme, each targeting exactly the modules our plan gives that scheme."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from llmcompressor import model_free_ptq

    spec = json.loads(Path(spec_file).read_text())
    groups = {}
    for scheme, modules in spec["sets"].items():
        how = LLMC_SCHEMES[scheme]
        targets = ["re:^(?:" + "|".join(re.escape(m) for m in modules) + ")$"]
        if "preset" in how:
            qs = preset_name_to_scheme(how["preset"], targets)
            qs = qs.model_copy(update={"format": how["format"]})
        else:
            qs = QuantizationScheme(targets=targets, format=how["format"],
                                    **{k: QuantizationArgs(**v) for k, v in how.items() if k != "format"})
        groups[scheme] = qs
    config = QuantizationConfig(config_groups=groups, ignore=[])
    torch.set_num_threads(spec["threads"])
    model_free_ptq(spec["src"], spec["out"], config=config, max_workers=spec["workers"], device="cpu")


def bench_llm_compressor(src: Path, work: Path, python: str, targets: list[str], ours: list[dict],
                         repeat: int = 1, path: str | None = None) -> list[dict]:
    """llm-compressor's model-free path (run by ``python``, which has it importable) on the same
    checkpoint, asked to quantize exactly the tensors our plan quantizes, in the same formats (see
    ``LLMC_SCHEMES``); both tools' output inventories; the speed ratio to our default-shard run."""
    env = dict(os.environ)
    if path:  # llm-compressor installed apart (pip install --no-deps --target DIR): only its runs see it
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    probe = subprocess.run([python, "-c", "import llmcompressor"], capture_output=True, text=True, env=env)
    if probe.returncode:  # say why: a --no-deps install misses a dependency more often than llmcompressor itself
        why = (probe.stderr.strip().splitlines() or ["no error output"])[-1]
        print(f"llm-compressor not importable by {python} ({why}): skipping the side-by-side", file=sys.stderr)
        return []
    rows = []
    nbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    cores = os.cpu_count() or 1
    for target in targets:
        sets = our_tensor_sets(src, target)
        out = work / f"llmc-{target}"
        ours_out = work / f"ours-{target}"
        spec = work / f"llmc-{target}.json"
        spec.write_text(json.dumps({"src": str(src), "out": str(out), "sets": sets, "workers": cores, "threads": 1}))
        runs = []
        for _ in range(repeat):
            shutil.rmtree(out, ignore_errors=True)
            runs.append(run_measured([python, __file__, "--llmc-spec", str(spec)], env=env))
        runs.sort(key=lambda r: r["seconds"])
        r = runs[len(runs) // 2]
        theirs = inventory(out)
        shutil.rmtree(out, ignore_errors=True)  # a few GB: on tmpfs it would squeeze the page cache
        shutil.rmtree(ours_out, ignore_errors=True)
        subprocess.run(["kimi-quant", "convert", str(src), "-t", target, "-o", str(ours_out), "--quiet"], check=True,
                       stdout=subprocess.DEVNULL)
        mine = inventory(ours_out)
        shutil.rmtree(ours_out, ignore_errors=True)
        gbps = nbytes / r["seconds"] / 1e9
        same = [o for o in ours if o["target"] == target and o["options"] == "" and o["shard"] == "4GiB"
                and o["workers"] in (None, cores)]
        core_s_per_gb = r["cores_busy"] * r["seconds"] / (nbytes / 1e9)
        rows.append({"tool": "llm-compressor", "target": target, "quantized": {k: len(v) for k, v in sets.items()},
                     "runs": repeat, "seconds": round(r["seconds"], 2), "gbps": round(gbps, 3),
                     "cores_busy": round(r["cores_busy"], 2), "core_s_per_gb": round(core_s_per_gb, 3),
                     "loadavg_1m": round(os.getloadavg()[0], 2), "peak_rss_tree_mb": r["peak_rss_tree"] >> 20,
                     # ours at the default shard size and one worker per core: wall time, and CPU time
                     "kimi_quant_speedup": round(same[0]["gbps"] / gbps, 1) if same else None,
                     "kimi_quant_speedup_cpu": round(core_s_per_gb / same[0]["core_s_per_gb"], 1) if same else None,
                     "inventory_llmc": theirs, "inventory_kimi_quant": mine})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/kq-bench", help="where the synthetic source lives")
    ap.add_argument("--out", default=None, help="where outputs go (default: --work; /dev/shm measures compute, not disk)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--double", action="store_true", help="also run with twice the experts (flat-memory check)")
    ap.add_argument("--released", action="store_true",
                    help="also convert the same model with its routed experts as Kimi K3 is published (MXFP4, "
                         "compressed-tensors): 950dt repacks them, a3 decodes them")
    ap.add_argument("--targets", nargs="+", default=["a3", "950dt"])
    ap.add_argument("--workers", type=int, nargs="+", default=[None],
                    help="worker counts to run (e.g. 1 2: how conversion scales; default: one per core)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per target: the median is reported (and the best)")
    ap.add_argument("--max-shard-size", nargs="+", default=["128MiB"],
                    help="output shard sizes to run (e.g. 4GiB 128MiB: the default and a small one)")
    ap.add_argument("--llm-compressor", action="store_true", help="also run llm-compressor model_free_ptq")
    ap.add_argument("--llm-compressor-python", default=sys.executable,
                    help="interpreter that has llmcompressor importable (PYTHONPATH is passed on), e.g. this one "
                         "with PYTHONPATH=DIR after pip install --no-deps --target DIR (see the bench extra)")
    ap.add_argument("--llm-compressor-path", help="a folder llm-compressor was installed into (pip install --no-deps "
                    "--target DIR ...): put on PYTHONPATH for its runs only")
    ap.add_argument("--llm-compressor-repeat", type=int, default=1,
                    help="llm-compressor runs per target (each is ~40x slower than ours)")
    ap.add_argument("--llmc-spec", help=argparse.SUPPRESS)  # internal: run llm-compressor on a spec (run_llmc)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--also-hash-inputs", action="store_true",
                    help="repeat each conversion with --hash-inputs (sha256 of every local source shard)")
    ap.add_argument("--warm-memory", type=float, default=0, metavar="GIB",
                    help="first touch this many GiB of memory (twice), so a freshly booted VM's first-touch cost "
                         "(the host backing guest pages) is paid before anything is measured; e.g. 16")
    ap.add_argument("--recache", action="store_true",
                    help="drop the source's page cache before measuring (the first read brings it back): the same "
                         "page-cache state in every session (see src_map_core_s_per_gb in the rows)")
    args = ap.parse_args()
    if args.llmc_spec:
        return run_llmc(args.llmc_spec)
    precompile()
    print(json.dumps({"cores": os.cpu_count(), "free_page_reporting_order": free_page_reporting()}), flush=True)
    if args.warm_memory:
        first, second = warm_memory(args.warm_memory)
        print(json.dumps({"warm_memory_gib": args.warm_memory, "first_touch_gbps": round(first, 2),
                          "second_touch_gbps": round(second, 2)}), flush=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or args.work)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shard in args.max_shard_size:
        for workers in args.workers:
            def measure(experts: int, extra: list[str] = ()) -> list[dict]:
                return bench(synth(work, experts), out, args.targets, workers, shard, extra, repeat=args.repeat,
                             fresh_cache=args.recache)

            rows += measure(args.experts)
            if args.also_hash_inputs:
                rows += measure(args.experts, ["--hash-inputs"])
            if args.double:
                rows += measure(2 * args.experts)
            if args.released:
                rows += bench(synth(work, args.experts, "mxfp4"), out, args.targets, workers, shard,
                              repeat=args.repeat, fresh_cache=args.recache)
    if args.llm_compressor:
        rows += bench_llm_compressor(synth(work, args.experts), out, args.llm_compressor_python, args.targets, rows,
                                     repeat=args.llm_compressor_repeat, path=args.llm_compressor_path)
    print(f"cores: {os.cpu_count()}")
    for r in rows:
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
