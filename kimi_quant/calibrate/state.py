"""The calibrated driver's state between layers (``kimi_quant_calib_state.safetensors`` in the output): the
activations after the last finished layer and the run's counts, bound to the computation that made them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from ..errors import KimiQuantError
from ..layout.ascend_v1 import CALIB_STATE
from ..runtime import forward as fw
from ..write import write_atomic
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
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save_state(out_dir: Path, binding: str, layer: int, states: list, stats: dict, expert_tokens: list[int]) \
        -> None:
    from safetensors.torch import save

    tensors = {}
    for b, st in enumerate(states):
        tensors[f"x.{b}"] = st.x.cpu().contiguous()  # the forward's device may be another
        for k, blk in enumerate(st.blocks):
            tensors[f"blocks.{b}.{k}"] = blk.cpu().contiguous()
    bad = next((n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    if bad is not None:  # a NaN state would be resumed from forever, blamed on the source: never saved
        raise KimiQuantError(f"calibration: the activations after layer {layer} hold a NaN or Inf ({bad}): the "
                             "source's weights of that layer overflow in the BF16 forward; it cannot be calibrated "
                             "(convert without --calibrate)")
    meta = {"binding": binding, "layer": str(layer), "batches": str(len(states)),
            "stats": json.dumps(stats, sort_keys=True), "expert_tokens": json.dumps(expert_tokens)}
    meta["digest"] = state_digest(tensors, meta)
    write_atomic(out_dir / STATE_FILE, save(tensors, metadata=meta))


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
