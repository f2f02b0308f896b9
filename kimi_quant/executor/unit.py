"""Convert one job in a worker process (local pool or a Ray task): a part of an output shard
(``convert_part``, what the driver schedules) or a whole shard (``convert_unit``).

Only paths and the job's JSON come in; only small dicts go back. Tensors are read one at a time
from mmap and their pages dropped after use, so a worker's memory is about one tensor's output
plus fixed buffers, whatever the checkpoint or shard size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..dtypes import nonfinite, to_f32
from ..errors import BadCheckpoint
from ..hashing import sha256_file
from ..plan import TensorPlan, UnitPlan
from ..quant import decode_mxfp4, decode_mxfp4_bf16, get_codec
from ..recipe.recipe import FLOAT
from ..source.compressed import MX_BLOCK, check_mxfp4_scales
from ..source.safetensors import SafetensorsReader
from ..write import PartWriter, ShardWriter, finish_shard

CHUNK = 64 * 1024 * 1024  # FLOAT tensors stream through in chunks of this many bytes


def check_codec_outputs(scheme: str, outputs: list, arrays, where: str) -> None:
    """The one gate between a codec and the writer: no NaN or Inf (of the output's dtype, or of E8M0
    for MX scales) and no scale of zero or below is ever written, whatever the codec computed (int4
    ``scale_bias`` of weights near the bf16 maximum overflows float32, for one)."""
    e8m0 = get_codec(scheme).e8m0_outputs
    for (name, dtype, _), arr in zip(outputs, arrays):
        suffix = name.rsplit(".", 1)[-1]
        bad = nonfinite(arr, "F8_E8M0" if suffix in e8m0 else dtype)
        if not bad and suffix in ("weight_scale", "weight_scale_second") and dtype in ("F32", "F16") \
                and not bool(np.all(arr > 0)):
            raise BadCheckpoint(f"{where}: {scheme} gives {name} a scale of zero or below; refusing to write it")
        if bad:
            raise BadCheckpoint(f"{where}: {scheme} gives {name} a NaN or Inf (weights too close to the top of the "
                                "float range?); refusing to write it (keep this tensor FLOAT with --override, or fix "
                                "the weights)")


def run_job(job: dict, paths: dict[str, str], out_dir: str, progress: Callable[[int], None] | None = None,
            remote: bool = False) -> dict:
    """What an executor runs: ``finish_shard`` for a finish job, ``convert_part`` for a part job (it
    names a ``partial`` file), else ``convert_unit``. ``remote``: the driver may be on another node (a
    part is then flushed to disk before it counts as written)."""
    if job.get("finish"):
        out = Path(out_dir)
        return {"file": job["file"], "size": job["size"],
                "sha256": finish_shard(out / job["partial"], out / job["file"], job["size"])}
    if "partial" in job:
        return convert_part(job, paths, out_dir, progress, sync=remote)
    return convert_unit(job, paths, out_dir, progress)


def job_key(job: dict) -> str:
    """Names one job among a run's jobs (progress is counted per job)."""
    return f"{job['file']}#{job['part']}" if "part" in job else f"{job['file']}#finish" if job.get("finish") else job["file"]


def _hash_inputs(job: dict, paths: dict[str, str]) -> dict[str, str]:
    """sha256 of the source files ``job["hash_inputs"]`` names, for the provenance: each file is given
    to one job, so hashing spreads over the workers instead of queueing on the driver."""
    identities = job.get("identities") or {}
    return {f: sha256_file(paths[f], identity=identities.get(f)) for f in job.get("hash_inputs") or []}


def convert_part(job: dict, paths: dict[str, str], out_dir: str,
                 progress: Callable[[int], None] | None = None, sync: bool = False) -> dict:
    """Write the tensors of ``job`` (a part of output shard ``job["file"]``) into the shard's
    temporary file ``job["partial"]``, which the driver created with the header, at the byte
    offsets ``job["offsets"]``; return {file, part, inputs}. A ``whole`` job (the part is the
    whole shard) also hashes and renames the shard: its result adds size and sha256."""
    tensors = [TensorPlan(**t) for t in job["tensors"]]
    entries = {name: (dt, tuple(shape)) for t in tensors for name, dt, shape in t.outputs}
    whole = bool(job.get("whole"))
    writer = PartWriter(Path(out_dir) / job["partial"], job["offsets"], entries, job["file"], whole=whole,
                        take_turns=bool(job.get("take_turns")))
    res = {"file": job["file"], "part": job["part"]}
    try:
        _convert_tensors(tensors, paths, writer, progress, job.get("identities"))
        if whole:
            res["size"], res["sha256"] = writer.commit()
        else:
            writer.close(sync=sync)
    finally:
        writer.close(write_held=False)  # after an error: the driver removes the file
    res["inputs"] = _hash_inputs(job, paths)
    return res


def convert_unit(unit: dict | UnitPlan, paths: dict[str, str], out_dir: str,
                 progress: Callable[[int], None] | None = None) -> dict:
    """Write output shard ``unit.file`` into ``out_dir`` in one stream; return {file, size, sha256, inputs}."""
    job = unit if isinstance(unit, dict) else {}
    unit = unit if isinstance(unit, UnitPlan) else UnitPlan.from_json(unit)
    entries = [(name, dt, tuple(shape)) for t in unit.tensors for name, dt, shape in t.outputs]
    writer = ShardWriter(Path(out_dir) / unit.file, entries)
    try:
        _convert_tensors(unit.tensors, paths, writer, progress)
        size, sha = writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {"file": unit.file, "size": size, "sha256": sha, "inputs": _hash_inputs(job, paths)}


def _convert_tensors(tensors: list[TensorPlan], paths: dict[str, str], writer,
                     progress: Callable[[int], None] | None, identities: dict[str, str] | None = None) -> None:
    """Quantize (or copy) ``tensors`` in order into ``writer`` (a ShardWriter or a PartWriter);
    ``identities``: the source files the driver vetted (any other file under those names is refused)."""
    readers: dict[str, SafetensorsReader] = {}

    def reader_of(file: str) -> SafetensorsReader:
        if file not in readers:
            readers[file] = SafetensorsReader(paths[file], (identities or {}).get(file))
        return readers[file]

    try:
        for t in tensors:
            write_tensor(writer, reader_of, t)
            if progress:
                progress(t.in_bytes)
    finally:
        for r in readers.values():
            r.close()


def _checked_array(reader: SafetensorsReader, name: str, dtype: str, shape) -> np.ndarray:
    where = f"{reader.path}: tensor {name!r}"
    info = reader.info(name)
    if info.dtype != dtype or list(info.shape) != list(shape):
        raise BadCheckpoint(f"{where}: is {info.dtype}{list(info.shape)} but the plan expected "
                            f"{dtype}{list(shape)} (source changed since planning?)")
    return reader.array(name)


def read_source(reader_of: Callable[[str], SafetensorsReader], t) -> tuple[np.ndarray, ...]:
    """The source arrays of ``t`` as planned: (bf16/float storage,) or, for a packed MXFP4 pair,
    (codes, scales); each checked against the plan (a source changed since planning is refused)."""
    if not t.packed:
        return (_checked_array(reader_of(t.file), t.name, t.dtype, t.shape),)
    (codes_name, codes_file), (scales_name, scales_file) = t.packed
    n, k = t.shape
    codes = _checked_array(reader_of(codes_file), codes_name, "U8", (n, k // 2))
    scales = _checked_array(reader_of(scales_file), scales_name, "U8", (n, k // MX_BLOCK))
    check_mxfp4_scales(scales, f"{reader_of(codes_file).path}: tensor {t.name!r}")
    return codes, scales


def release_source(reader_of: Callable[[str], SafetensorsReader], t) -> None:
    """Drop the mapped pages of ``t``'s source tensors (after they have been consumed)."""
    for name, file in t.packed or [(t.name, t.file)]:
        reader_of(file).release(name)


def source_f32(reader_of: Callable[[str], SafetensorsReader], t) -> np.ndarray:
    """``t``'s source values as float32 (a packed MXFP4 pair decoded exactly)."""
    return _decoded(read_source(reader_of, t), t.dtype, bool(t.packed))


def _decoded(parts: tuple[np.ndarray, ...], dtype: str, packed: bool) -> np.ndarray:
    return decode_mxfp4(*parts) if packed else to_f32(parts[0], dtype)


@dataclass(frozen=True)
class SourceValues:
    """A source tensor's arrays as stored (BF16 / float, or a packed MXFP4 pair: codes, scales), copied out of its
    shard: what a GPTQ job carries to its worker (2 B per BF16 weight, ~0.53 B packed, against 4 B as float32).
    ``f32()`` decodes them as ``source_f32`` does."""

    parts: tuple[np.ndarray, ...]
    dtype: str
    packed: bool

    def f32(self) -> np.ndarray:
        return _decoded(self.parts, self.dtype, self.packed)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def source_values(reader_of: Callable[[str], SafetensorsReader], t) -> SourceValues:
    """``t``'s source arrays, checked as ``read_source`` checks them, copied (the shard's pages may go)."""
    return SourceValues(tuple(np.array(p, copy=True) for p in read_source(reader_of, t)), t.dtype, bool(t.packed))


def write_tensor(writer: ShardWriter, reader_of: Callable[[str], SafetensorsReader], t,
                 quantized: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray] | None:
    """Write source tensor ``t`` (a TensorPlan) into ``writer``: FLOAT bytes streamed through, or its
    codec's output. ``reader_of(file)``: the open reader of a source shard. ``quantized``, when given, is
    the codec's output computed elsewhere (the calibrated path's GPTQ), written instead of the data-free
    rule's. A packed MXFP4 source becomes W4A8_MXFP as it is (whatever ``quantized``: the source's values
    are already on that grid) and is decoded exactly for any other scheme. Returns the quantized outputs
    (None for FLOAT)."""
    where = f"{reader_of(t.file).path}: tensor {t.name!r}"
    out = None
    if t.scheme == FLOAT and not t.packed:
        read_source(reader_of, t)  # checks the dtype and shape the plan saw
        _copy_float(writer, reader_of(t.file), t, where)
    elif t.scheme == FLOAT:  # a packed tensor kept in float: its exact values as BF16 (the output's dtype)
        w = decode_mxfp4_bf16(*read_source(reader_of, t))
        if nonfinite(w, "BF16"):
            raise BadCheckpoint(f"{where}: decodes to values beyond the BF16 range")
        writer.write(t.outputs[0][0], w)
    else:
        codec = t.codec
        try:
            if t.repack:
                out = codec.from_mxfp4(*read_source(reader_of, t))
            elif quantized is not None:
                out = quantized
            elif t.packed:  # the decoded values are exact in bf16 (1-bit mantissas), so the fast path takes them
                out = codec.quantize_bf16(decode_mxfp4_bf16(*read_source(reader_of, t)), t.matmul)
            elif t.dtype == "BF16":
                out = codec.quantize_bf16(read_source(reader_of, t)[0], t.matmul)
            else:
                out = codec.quantize(read_source(reader_of, t)[0].astype(np.float32), t.matmul)
        except ValueError as e:  # codecs refuse NaN / Inf
            raise BadCheckpoint(f"{where}: {e}") from None
        check_codec_outputs(t.scheme, t.outputs, out.values(), where)
        for (name, _, _), arr in zip(t.outputs, out.values()):
            writer.write(name, arr)
    readers = [(reader_of(file), name) for name, file in t.packed or [(t.name, t.file)]]
    writer.after_hashed(lambda: [reader.release(name) for reader, name in readers])  # it may hash source pages
    return out


def _copy_float(writer: ShardWriter, reader: SafetensorsReader, t, where: str) -> None:
    """Stream a FLOAT tensor's bytes through unchanged, checking for NaN/Inf chunk by chunk."""
    arr = reader.array(t.name).reshape(-1)
    step = max(1, CHUNK // max(arr.itemsize, 1))
    start = reader.info(t.name).start

    def chunks():
        for i in range(0, arr.size, step):
            chunk = arr[i:i + step]
            if nonfinite(chunk, t.dtype):
                raise BadCheckpoint(f"{where}: contains NaN or Inf")
            yield chunk
            writer.after_hashed(functools.partial(reader.release_range, start + i * arr.itemsize, chunk.nbytes))

    writer.write_chunks(t.outputs[0][0], chunks())
