"""Issue 31, classes 4, 5 and 9: a calibrated run's saved state is bound to what fed it (every source
shard, the calibration tokens, the settings) and to its own digest; anything else is discarded with one
line and the calibration redone. A run with other calibration settings is named as such, and the
command that finishes the output carries them."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import fresh_copy, kq, refused_calibrated_resume, snapshot  # noqa: E402

from kimi_quant.calibrate import CalibConfig  # noqa: E402
from kimi_quant.calibrate import run as calib_run  # noqa: E402
from kimi_quant.calibrate import state as calib_state  # noqa: E402
from kimi_quant.convert import ConvertOptions, convert  # noqa: E402
from kimi_quant.layout.ascend_v1 import PROVENANCE  # noqa: E402
from kimi_quant.synth import synth  # noqa: E402
from kimi_quant.source.safetensors import SafetensorsReader  # noqa: E402
from kimi_quant.verify import verify_output  # noqa: E402
from kimi_quant.write import ShardWriter  # noqa: E402

torch.set_num_threads(1)
TOKENS = 1024
EMBED = "language_model.model.embed_tokens.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return synth("tiny", tmp_path_factory.mktemp("calsec") / "tiny-bf16")


def _convert(source, out):
    return convert(str(source), ConvertOptions(target="a3", output=Path(out), quiet=True, workers=1,
                                               calibrate=CalibConfig(tokens=TOKENS)))


def _shards(out: Path) -> dict[str, str]:
    return {k: v for k, v in snapshot(out).items() if k.startswith("quant_model_weights-")}


class _Interrupt(BaseException):
    pass


def _interrupted(source, out, monkeypatch, at: int = 150):
    """A calibrated run killed inside layer 2, its state after layer 1 saved."""
    real_put, n = calib_run.UnitWriter.put, {"puts": 0}

    def put(self, t, quantize=None):
        n["puts"] += 1
        if n["puts"] == at:
            raise _Interrupt()
        return real_put(self, t, quantize)

    monkeypatch.setattr(calib_run.UnitWriter, "put", put)
    with pytest.raises(_Interrupt):
        _convert(source, out)
    monkeypatch.setattr(calib_run.UnitWriter, "put", real_put)
    assert (out / calib_run.STATE_FILE).exists()


def _layers_run(monkeypatch) -> list[int]:
    run, real = [], calib_run._layer

    def layer(tcfg, i, *a, **k):
        run.append(i)
        return real(tcfg, i, *a, **k)

    monkeypatch.setattr(calib_run, "_layer", layer)
    return run


def _embed_file(src: Path) -> str:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return index["weight_map"][EMBED]


def _rewrite(path: Path, edit) -> None:
    with SafetensorsReader(path) as r:
        tensors = {n: (t.dtype, tuple(t.shape), np.array(r.array(n))) for n, t in
                   sorted(r.tensors.items(), key=lambda kv: kv[1].start)}
    edit(tensors)
    w = ShardWriter(path, [(n, dt, s) for n, (dt, s, _) in tensors.items()])
    for n, (_, _, a) in tensors.items():
        w.write(n, a)
    w.commit()


def test_resume_after_the_embedding_changed_redoes_everything(source, tmp_path, monkeypatch, caplog):
    src = fresh_copy(source, tmp_path, "src")
    out = tmp_path / "out"
    _interrupted(src, out, monkeypatch)

    def bump(tensors):  # a different embedding row, same shape and dtype: the stamp changes, not the size
        dt, s, a = tensors[EMBED]
        a = a.copy()
        a.reshape(-1)[:64] ^= 0x0100
        tensors[EMBED] = (dt, s, a)

    _rewrite(src / _embed_file(src), bump)
    run = _layers_run(monkeypatch)
    with caplog.at_level(logging.WARNING):
        _convert(src, out)
    assert run[0] == 0, run  # nothing reused: every layer's Hessians come from the embedding
    lines = [r.getMessage() for r in caplog.records if "discarded" in r.getMessage()]
    assert len(lines) == 1 and "computed from other inputs" in lines[0], caplog.text
    verify_output(out)
    fresh = tmp_path / "fresh"
    _convert(src, fresh)
    assert _shards(out) == _shards(fresh)  # the shards of the edited source, not a mix


def _forge(out: Path, edit) -> None:
    """Rewrite the saved state through ``edit(tensors, meta)``, recomputing its digest as an attacker
    (or a bug) could: only the checks on what the state holds are left to catch it."""
    from safetensors import safe_open
    from safetensors.torch import save

    path = out / calib_run.STATE_FILE
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    edit(tensors, meta)
    meta.pop("digest")
    meta["digest"] = calib_state.state_digest(tensors, meta)
    path.write_bytes(save(tensors, metadata=meta))


def _scale(tensors, meta):
    tensors["x.0"] = tensors["x.0"] * 2


def _batches_zero(tensors, meta):
    for n in list(tensors):
        del tensors[n]
    meta["batches"] = "0"


def _drop_token(tensors, meta):
    tensors["x.0"] = tensors["x.0"][:, :-1].contiguous()


def _nan(tensors, meta):
    tensors["x.0"][0, 0, 0] = float("nan")


def _stats(tensors, meta):
    meta["stats"] = json.dumps({"gptq_tensors": -5})


@pytest.mark.parametrize("edit, why", [
    (_scale, None), (_batches_zero, "0 batches"), (_drop_token, "batch 0 has shape"), (_nan, "NaN"),
    (_stats, "not counts")])
def test_a_tampered_state_is_discarded_with_one_line(source, tmp_path, monkeypatch, caplog, edit, why):
    if not hasattr(test_a_tampered_state_is_discarded_with_one_line, "reference"):
        ref = tmp_path / "ref"
        _convert(source, ref)
        test_a_tampered_state_is_discarded_with_one_line.reference = _shards(ref), json.loads(
            (ref / PROVENANCE).read_text())["calibration"]["stats"]
    want_shards, want_stats = test_a_tampered_state_is_discarded_with_one_line.reference
    out = tmp_path / "out"
    _interrupted(source, out, monkeypatch)
    if why is None:  # edited without recomputing the digest
        from safetensors import safe_open
        from safetensors.torch import save

        path = out / calib_run.STATE_FILE
        with safe_open(str(path), framework="pt") as f:
            meta, tensors = dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys()}
        edit(tensors, meta)
        path.write_bytes(save(tensors, metadata=meta))
        why = "digest does not match"
    else:
        _forge(out, edit)
    run = _layers_run(monkeypatch)
    with caplog.at_level(logging.WARNING):
        _convert(source, out)
    lines = [r.getMessage() for r in caplog.records if "discarded" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0], caplog.text
    assert run[0] == 0
    verify_output(out)
    assert _shards(out) == want_shards
    assert json.loads((out / PROVENANCE).read_text())["calibration"]["stats"] == want_stats


def test_other_calibration_settings_are_named_and_the_finish_command_carries_them(source, tmp_path):
    line, args = refused_calibrated_resume(source, tmp_path / "out", ("--calib-tokens", "512", "--damp", "0.05"),
                                           ("--calib-tokens", "1024"))
    assert "--calibrate was" in line and "--tokens 512" in line, line
    assert "the source's shards" not in line
    assert args[:2] == ["kimi-quant", "convert"] and "--calibrate" in args and "--damp" in args, line
    again = kq(*args[1:], "-q")
    assert again.returncode == 0, again.stderr  # the command it names is accepted, and finishes the output
