"""The calibrated driver's state between layers (``kimi_quant_calib_state.safetensors`` in the output): the
activations after the last finished layer and the run's counts, bound to the computation that made them."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from ..errors import KimiQuantError
from ..layout.ascend_v1 import CALIB_STATE
from ..runtime import forward as fw
from ..write.atomic import disk_full, fsync_dir
from ..write.safetensors_writer import encode_header
from .config import CalibConfig

STATE_FILE = CALIB_STATE
log = logging.getLogger(__name__)


def state_binding(fingerprint: str, made_from: dict[str, dict[str, str]], info: dict, cfg: CalibConfig) -> str:
    """What a saved state was computed from: the conversion (plan fingerprint), the identity of every
    source shard, the calibration tokens' digest and the calibration settings. A state saved under
    another binding is another computation's: never resumed from."""
    inputs = {f: ident for m in made_from.values() for f, ident in m.items()}
    ident = {"fingerprint": fingerprint, "inputs": dict(sorted(inputs.items())),
             "token_sha256": info.get("token_sha256"), "calibration": cfg.describe()}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


def state_digest(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """sha256 of ``meta`` and the tensors: in pass order (each pass's x, then its blocks: the order they are written
    in) when ``meta`` says ``order: passes``, else in name order (checkpoints of earlier versions)."""
    names = _pass_order(tensors) if meta.get("order") == "passes" else sorted(tensors)
    h = _digest_start(meta)
    for name in names:
        _digest_add(h, name, tensors[name].contiguous())
    return h.hexdigest()


def _pass_order(names) -> list[str]:
    def key(name: str):
        kind, _, rest = name.partition(".")
        b, _, k = rest.partition(".")
        return (int(b), -1 if kind == "x" else int(k), name) if b.isdigit() and (kind == "x" or k.isdigit()) \
            else (1 << 62, 0, name)
    return sorted(names, key=key)


def _digest_start(meta: dict[str, str]):
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode())


def _digest_add(h, name: str, t: torch.Tensor) -> None:
    h.update(f"\0{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
    h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")  # the tensor's own bytes, not a copy


#: safetensors' names of the states' dtypes
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_PLACEHOLDER = "0" * 64  # the digest's place in the header, written once the data is


def state_layout(states: list) -> list[list[tuple[torch.dtype, tuple[int, ...]]]]:
    """Per pass the (dtype, shape) of its x and its blocks: what ``save_state`` declares before the data."""
    return [[(t.dtype, tuple(t.shape)) for t in (st.x, *st.blocks)] for st in states]


def save_state(out_dir: Path, binding: str, layer: int, layout: list, passes: Iterable, stats: dict,
               expert_tokens: list[int]) -> None:
    """Checkpoint the state after ``layer``: ``passes`` (one ``fw.State`` per pass, on any device, taken one at
    a time: the run may hold them in other processes) as ``layout`` (``state_layout``) declares them. Streamed to
    a ``.partial`` file, its digest put in the header once every byte is written, then renamed: at most one pass
    is held here, and a file under the final name is complete."""
    entries = [(f"x.{b}" if k == 0 else f"blocks.{b}.{k - 1}", _DTYPES[dt], shape)
               for b, ts in enumerate(layout) for k, (dt, shape) in enumerate(ts)]
    meta = {"binding": binding, "layer": str(layer), "batches": str(len(layout)), "order": "passes",
            "stats": json.dumps(stats, sort_keys=True), "expert_tokens": json.dumps(expert_tokens)}
    h = _digest_start(meta)
    head = encode_header(entries, {**meta, "digest": _PLACEHOLDER})
    at = head.index(f'"digest":"{_PLACEHOLDER}"'.encode()) + len('"digest":"')
    path = out_dir / STATE_FILE
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            names = iter(entries)
            for b, st in enumerate(passes):
                ts = (st.x, *st.blocks)
                if b >= len(layout) or len(ts) != len(layout[b]):
                    raise RuntimeError(f"calibration state: pass {b} has {len(ts)} tensors, declared "
                                       f"{len(layout[b]) if b < len(layout) else 0}")
                for t in ts:
                    name, dtype, shape = next(names)
                    t = t.cpu().contiguous()  # the forward's device may be another
                    if _DTYPES[t.dtype] != dtype or tuple(t.shape) != shape:
                        raise RuntimeError(f"calibration state: {name} is {t.dtype} {list(t.shape)}, "
                                           f"declared {dtype} {list(shape)}")
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        # a NaN state would be resumed from forever, blamed on the source: never saved
                        raise KimiQuantError(f"calibration: the activations after layer {layer} hold a NaN or Inf "
                                             f"({name}): the source's weights of that layer overflow in the BF16 "
                                             "forward; it cannot be calibrated (convert without --calibrate)")
                    _digest_add(h, name, t)
                    f.write(t.view(torch.uint8).numpy().data if t.numel() else b"")
            if next(names, None) is not None:
                raise RuntimeError("calibration state: fewer tensors than declared")
            f.seek(at)
            f.write(h.hexdigest().encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise disk_full(path, e) from None
        raise
    fsync_dir(path.parent)


def load_state(out_dir: Path, binding: str, windows: list[torch.Tensor]):
    """(layer, states, stats, expert tokens) from a checkpoint of this very computation, else None: one saved under
    another binding (another source, calibration text or setting), failing its own digest, with
    another number of batches or shapes than ``windows``, or holding a NaN is discarded, with one line."""
    from safetensors import safe_open

    path = out_dir / STATE_FILE
    if not os.path.lexists(path):
        return None
    why = None
    try:
        if path.is_symlink() or not path.is_file():
            raise ValueError("not a plain file")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("binding") != binding:
                raise ValueError("it was computed from other inputs (the source's shards, the calibration text "
                                 "or its settings changed)")
            layer, nb = int(meta["layer"]), int(meta["batches"])
            if nb != len(windows):
                raise ValueError(f"it holds {nb} batches, the calibration has {len(windows)}")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        if meta.get("digest") != state_digest(tensors, {k: v for k, v in meta.items() if k != "digest"}):
            raise ValueError("its digest does not match its content")
        states = []
        for b in range(nb):
            x = tensors[f"x.{b}"]
            if tuple(x.shape[:2]) != tuple(windows[b].shape[:2]):
                raise ValueError(f"batch {b} has shape {list(x.shape)}, its tokens {list(windows[b].shape)}")
            blocks, k = [], 0
            while f"blocks.{b}.{k}" in tensors:
                blocks.append(tensors[f"blocks.{b}.{k}"])
                k += 1
            states.append(fw.State(x, blocks))
        if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors.values()):
            raise ValueError("it holds a NaN or Inf")
        stats = json.loads(meta.get("stats", "{}"))
        expert_tokens = json.loads(meta.get("expert_tokens", "[]"))
        if not isinstance(stats, dict) or not all(isinstance(k, str) and type(v) is int and v >= 0
                                                  for k, v in stats.items()) \
                or not isinstance(expert_tokens, list) or not all(type(v) is int and v >= 0 for v in expert_tokens):
            raise ValueError("its counts are not counts")
        return layer, states, stats, expert_tokens
    except Exception as e:  # noqa: BLE001 - a torn, foreign or stale file: start over (it is only a shortcut)
        why = " ".join(str(e).split())[:160] or type(e).__name__
    log.warning("kimi-quant: warning: %s discarded (%s); the calibration starts again from the first layer",
                path, why)
    return None
