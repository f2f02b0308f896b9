"""run_validation / `kimi-quant validate` on the trained tiny fixture."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kimi_quant.errors import KimiQuantError
from kimi_quant.model.spec import load_model_spec
from kimi_quant.quant import get_codec
from kimi_quant.source.safetensors import SafetensorsReader
from kimi_quant.validate.run import format_table, perplexity_of_source, run_validation
from kimi_quant.write.safetensors_writer import encode_header

FIXTURE = Path(__file__).resolve().parents[1] / "kimi_quant" / "model" / "fixtures" / "tiny"
SMALL = dict(max_tokens=600, seq_len=200, progress=False)

torch.set_num_threads(1)


def write_ascend_dir(out: Path, source: Path = FIXTURE, quantize: dict[str, str] | None = None) -> Path:
    """An ascendV1 dir from ``source``: every tensor FLOAT except names mapped to a type in ``quantize``
    (quantized with the project's codecs)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = load_model_spec(source)
    quantize = quantize or {}
    desc = {"version": "1.0.0", "model_quant_type": "FLOAT", "group_size": 0, "metadata": {}, "optional": {}}
    entries, blobs = [], []
    with SafetensorsReader(source / "model.safetensors") as r:
        for name, info in r.tensors.items():
            qtype = quantize.get(name)
            if qtype is None:
                entries.append((name, info.dtype, info.shape))
                blobs.append(np.array(r.array(name)).tobytes())
                desc[name] = "FLOAT"
                continue
            w = (np.array(r.array(name)).astype(np.uint32) << 16).view(np.float32)
            parts = get_codec(qtype).quantize(w, spec.role(name).matmul)
            base = name[: -len("weight")]
            for suf, arr in parts.items():
                dt = {np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32"}[arr.dtype]
                if suf == "weight" and qtype == "W8A8_MXFP8":
                    dt = "F8_E4M3"
                entries.append((base + suf, dt, arr.shape))
                blobs.append(np.ascontiguousarray(arr).tobytes())
                desc[base + suf] = qtype
    shard = "quant_model_weights-00001-of-00001.safetensors"
    (out / shard).write_bytes(encode_header(entries) + b"".join(blobs))
    (out / "quant_model_weights.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(map(len, blobs))}, "weight_map": {e[0]: shard for e in entries}}))
    (out / "quant_model_description.json").write_text(json.dumps(desc))
    for f in ("config.json", "tiktoken.model", "tokenizer_config.json"):
        shutil.copy(source / f, out / f)
    return out


def test_fixture_heldout_perplexity_is_low():
    res = perplexity_of_source(FIXTURE, max_tokens=2048, seq_len=512, progress=False)
    assert res["tokens"] == 2048 - 4
    assert res["ppl"] < 20  # vocab 1024; the trained fixture scores ~6 on the held-out split


def test_all_float_output_matches_exactly(tmp_path):
    q = write_ascend_dir(tmp_path / "q")
    rep = run_validation(FIXTURE, q, json_path=tmp_path / "r.json", **SMALL)
    assert rep["ratio"] == 1.0 and rep["ppl_bf16"] == rep["ppl_quant"]
    assert rep["tokens"] == 600 - 3  # windows 200, 200, 200: 199 scored each
    assert len(rep["layers"]) == 6
    for e in rep["layers"]:
        assert e["rel_error"] == 0.0 and e["cosine"] == pytest.approx(1.0, abs=1e-9)
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert set(on_disk) >= {"ppl_bf16", "ppl_quant", "ratio", "tokens", "layers"}
    assert "ratio" in format_table(rep)


def test_window_convention_short_last_window(tmp_path):
    q = write_ascend_dir(tmp_path / "q")
    rep = run_validation(FIXTURE, q, max_tokens=450, seq_len=200, progress=False)
    assert rep["windows"] == 3 and rep["tokens"] == 199 + 199 + 49


def _expert_types(qtype_expert: str, qtype_dense: str) -> dict[str, str]:
    spec = load_model_spec(FIXTURE)
    out = {}
    for name in spec.expected_tensors(with_vision=False):
        role = spec.role(name).role
        if role.startswith(("routed_expert.", "shared_expert.")):
            out[name] = qtype_expert
        elif role in ("kda.qkv_proj", "mla.q_a_proj", "mla.q_b_proj", "mla.kv_a_proj", "dense_mlp.gate",
                      "dense_mlp.up", "dense_mlp.down", "latent_moe.down_proj", "latent_moe.up_proj"):
            out[name] = qtype_dense
    return out


@pytest.mark.parametrize("types", [("W4A8_DYNAMIC", "W8A8_DYNAMIC"), ("W4A8_MXFP", "W8A8_MXFP8")])
def test_quantized_dir_from_codecs(tmp_path, types):
    q = write_ascend_dir(tmp_path / "q", quantize=_expert_types(*types))
    rep = run_validation(FIXTURE, q, **SMALL)
    assert 1.0 <= rep["ratio"] < 1.5, rep["ratio"]
    assert all(0.9 < e["cosine"] < 1.0 and e["rel_error"] > 0 for e in rep["layers"])


def test_missing_tokenizer_is_one_line(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    (src / "tiktoken.model").unlink()
    q = write_ascend_dir(tmp_path / "q", source=FIXTURE)
    (q / "tiktoken.model").unlink()
    with pytest.raises(KimiQuantError, match="tiktoken.model"):
        run_validation(src, q, **SMALL)


def test_not_an_ascend_dir(tmp_path):
    with pytest.raises(KimiQuantError, match="quant_model_description.json"):
        run_validation(FIXTURE, FIXTURE, **SMALL)


def test_click_command(tmp_path):
    from click.testing import CliRunner

    from kimi_quant.validate.command import validate

    q = write_ascend_dir(tmp_path / "q")
    res = CliRunner().invoke(validate, [str(FIXTURE), str(q), "--max-tokens", "300", "--seq-len", "150",
                                        "--json", str(tmp_path / "rep.json"), "--quiet"])
    assert res.exit_code == 0, res.output
    assert "ratio 1.0000" in res.output
    rep = json.loads((tmp_path / "rep.json").read_text())
    assert rep["ratio"] == 1.0 and math.isfinite(rep["ppl_bf16"])
    bad = CliRunner().invoke(validate, [str(FIXTURE), str(FIXTURE), "--quiet"])
    assert bad.exit_code != 0 and "quant_model_description.json" in bad.output


def test_quantized_loader_activation_modes(tmp_path):
    from kimi_quant.runtime.weights import QuantizedLoader, SourceLoader

    q = write_ascend_dir(tmp_path / "q", quantize=_expert_types("W4A8_DYNAMIC", "W8A8_MXFP8"))
    with QuantizedLoader(q) as ql, SourceLoader(FIXTURE) as sl:
        w, act = ql.layer(1)
        wb, actb = sl.layer(1)
    assert actb == {}
    assert act["block_sparse_moe.experts.0.w1.weight"] == "int8"
    assert act["self_attn.q_proj.weight"] == "mxfp8"
    assert "self_attn.o_proj.weight" not in act  # FLOAT: no activation quantization
    assert set(w) == set(wb)
    for name in w:
        assert w[name].shape == wb[name].shape and w[name].dtype == torch.float32
        if name not in act:
            assert torch.equal(w[name], wb[name])
        else:
            rel = (w[name] - wb[name]).norm() / wb[name].norm()
            assert 0 < rel < 0.2, (name, rel)
