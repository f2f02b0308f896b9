"""The calibrated run's checkpoint between layers (calibrate/state.py): streamed pass by pass (the state may live in
Ray actors: the driver holds one pass at a time), its digest in the header once the data is written, never a file
under the final name that is not complete, a NaN refused before it is saved, and the earlier format still read."""

from __future__ import annotations

import json

import pytest
import torch

from kimi_quant.calibrate import state as cs
from kimi_quant.errors import KimiQuantError
from kimi_quant.runtime import forward as fw

BINDING = "b" * 64


def _states(seed: int = 0) -> list[fw.State]:
    g = torch.Generator().manual_seed(seed)
    return [fw.State(torch.randn(2, 8, 16, generator=g), [torch.randn(2, 8, 16, generator=g) for _ in range(k)])
            for k in (2, 2, 3)]


def _windows(states) -> list[torch.Tensor]:
    return [torch.zeros(st.x.shape[:2], dtype=torch.long) for st in states]


def test_a_streamed_state_loads_back_as_saved(tmp_path):
    states = _states()
    taken = []

    def passes():  # one pass at a time, as the Ray actors hand them over
        for st in states:
            taken.append(st)
            yield st

    cs.save_state(tmp_path, BINDING, 4, cs.state_layout(states), passes(), {"gptq_tensors": 7}, [1, 2, 3])
    assert len(taken) == 3 and not list(tmp_path.glob("*.partial"))
    layer, got, stats, tokens = cs.load_state(tmp_path, BINDING, _windows(states))
    assert (layer, stats, tokens) == (4, {"gptq_tensors": 7}, [1, 2, 3])
    for a, b in zip(states, got):
        assert torch.equal(a.x, b.x) and len(a.blocks) == len(b.blocks)
        assert all(torch.equal(p, q) for p, q in zip(a.blocks, b.blocks))


def test_a_nan_in_a_later_pass_is_refused_and_the_last_checkpoint_kept(tmp_path):
    good = _states()
    cs.save_state(tmp_path, BINDING, 3, cs.state_layout(good), iter(good), {}, [])
    before = (tmp_path / cs.STATE_FILE).read_bytes()
    bad = _states(1)
    bad[2].blocks[1][1, 2, 3] = float("inf")
    with pytest.raises(KimiQuantError) as e:
        cs.save_state(tmp_path, BINDING, 4, cs.state_layout(bad), iter(bad), {}, [])
    msg = str(e.value)
    assert "after layer 4" in msg and "blocks.2.1" in msg and "\n" not in msg
    assert (tmp_path / cs.STATE_FILE).read_bytes() == before and not list(tmp_path.glob("*.partial"))


def test_a_pass_unlike_its_declared_layout_is_refused(tmp_path):
    states = _states()
    layout = cs.state_layout(states)
    layout[1] = layout[1][:1]  # declared without its blocks
    with pytest.raises(RuntimeError, match="declared"):
        cs.save_state(tmp_path, BINDING, 0, layout, iter(states), {}, [])
    assert not list(tmp_path.iterdir())


def test_a_checkpoint_of_the_earlier_format_is_still_resumed_from(tmp_path):
    """Saved whole by safetensors with its digest over the tensors in name order (no ``order`` key)."""
    from safetensors.torch import save

    states = _states()
    tensors = {}
    for b, st in enumerate(states):
        tensors[f"x.{b}"] = st.x
        tensors.update((f"blocks.{b}.{k}", t) for k, t in enumerate(st.blocks))
    meta = {"binding": BINDING, "layer": "2", "batches": "3", "stats": json.dumps({}), "expert_tokens": "[]"}
    meta["digest"] = cs.state_digest(tensors, meta)
    (tmp_path / cs.STATE_FILE).write_bytes(save(tensors, metadata=meta))
    layer, got, _, _ = cs.load_state(tmp_path, BINDING, _windows(states))
    assert layer == 2 and all(torch.equal(a.x, b.x) for a, b in zip(states, got))
    # the same bytes under the new order's name would not pass: the digest binds the order
    meta2 = {**{k: v for k, v in meta.items() if k != "digest"}, "order": "passes"}
    assert cs.state_digest(tensors, meta2) != meta["digest"]
