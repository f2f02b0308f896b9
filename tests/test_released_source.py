"""Kimi K3 as Moonshot publishes it: compressed-tensors ``mxfp4-pack-quantized`` routed experts.

The fixtures are packed by compressed-tensors' own ``MXFP4PackedCompressor`` (the format's reference
implementation, from PyPI), so what we read is checked against the format's code, not our notes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest import error_line, kq

torch = pytest.importorskip("torch")
ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors (the test extra) makes these fixtures")
from compressed_tensors.compressors import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from kimi_quant.synth import synth  # noqa: E402
from kimi_quant.quant import decode_mxfp4  # noqa: E402

EXPERT_TARGETS = [r"re:.*block_sparse_moe\.experts\.\d+\.(w1|w2|w3)$"]
SCHEME = preset_name_to_scheme("MXFP4A16", EXPERT_TARGETS)
EXPERT_SUFFIXES = (".w1.weight", ".w2.weight", ".w3.weight")


def _is_expert(name: str) -> bool:
    return ".block_sparse_moe.experts." in name and name.endswith(EXPERT_SUFFIXES)


def ct_pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' MXFP4 of a bf16 [N, K] weight: its own scale rule and packer."""
    n, k = w.shape
    amax = w.float().view(n, k // 32, 32).abs().amax(-1)
    scale = (2.0 ** (generate_mx_scales(amax) - 127)).to(torch.bfloat16)
    return MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, SCHEME)


def ct_unpack(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, SCHEME)["weight"]


def write_released(bf16_dir: Path, out: Path, edit=None) -> Path:
    """``bf16_dir`` with its routed experts packed by compressed-tensors, shard by shard, and the config's
    quantization_config as compressed-tensors writes it. ``edit(tensors, config)`` may damage either."""
    out.mkdir(parents=True)
    index = json.loads((bf16_dir / "model.safetensors.index.json").read_text())
    weight_map = {}
    shards = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = {}
        for name, w in load_file(bf16_dir / file).items():
            if _is_expert(name):
                base = name[: -len(".weight")]
                for suffix, t in ct_pack(w).items():
                    tensors[f"{base}.{suffix}"] = t
            else:
                tensors[name] = w
        shards[file] = tensors
    config = json.loads((bf16_dir / "config.json").read_text())
    config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": SCHEME}, format="mxfp4-pack-quantized", quantization_status="compressed",
        ignore=["lm_head"]).to_dict()
    if edit:
        edit(shards, config)
    for file, tensors in shards.items():
        save_file(tensors, out / file)
        weight_map.update((n, file) for n in tensors)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config))
    for f in bf16_dir.iterdir():
        if not (out / f.name).exists() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


def write_decoded(released: Path, out: Path) -> Path:
    """The released checkpoint decoded to BF16 by compressed-tensors (the detour users must take today)."""
    out.mkdir(parents=True)
    index = json.loads((released / "model.safetensors.index.json").read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(released / file)
        dense = {}
        for name, t in tensors.items():
            if name.endswith(".weight_packed"):
                base = name[: -len("_packed")]
                dense[base] = ct_unpack(t, tensors[base + "_scale"])
            elif not (name.endswith(".weight_scale") and name[: -len("_scale")] + "_packed" in tensors):
                dense[name] = t
        save_file(dense, out / file)
        weight_map.update((n, file) for n in dense)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((released / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    for f in released.iterdir():
        if not (out / f.name).exists() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> Path:
    return synth("tiny", tmp_path_factory.mktemp("k3") / "bf16")


@pytest.fixture(scope="module")
def released(bf16, tmp_path_factory) -> Path:
    return write_released(bf16, tmp_path_factory.mktemp("k3") / "released")


@pytest.fixture(scope="module")
def decoded(released, tmp_path_factory) -> Path:
    return write_decoded(released, tmp_path_factory.mktemp("k3") / "decoded")


def _tensors(d: Path, stem: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob(f"{stem}*.safetensors")):
        out.update(load_file(f))
    return out


def _convert(src: Path, out: Path, *args: str):
    r = kq("convert", str(src), "-o", str(out), "--workers", "1", *args)
    assert r.returncode == 0, r.stderr
    return r


def test_decoding_matches_compressed_tensors(released):
    tensors = _tensors(released, "model")
    pairs = [n for n in tensors if n.endswith(".weight_packed")]
    assert len(pairs) == 5 * 16 * 3  # every routed expert of the tiny model's five MoE layers
    for name in pairs:
        scale = tensors[name[: -len("_packed")] + "_scale"]
        ours = decode_mxfp4(tensors[name].numpy(), scale.numpy())
        theirs = ct_unpack(tensors[name], scale).float().numpy()
        np.testing.assert_array_equal(ours, theirs)


def test_950dt_experts_are_the_source_bytes(released, decoded, tmp_path):
    """950dt from the release is a repack: every routed expert's codes and scales are the source's own
    bytes. From the decoded BF16 (the detour) they decode to the same values."""
    _convert(released, tmp_path / "out", "-t", "950dt")
    assert kq("verify", str(tmp_path / "out")).returncode == 0
    src, out = _tensors(released, "model"), _tensors(tmp_path / "out", "quant_model_weights")
    description = json.loads((tmp_path / "out" / "quant_model_description.json").read_text())
    pairs = [n[: -len(".weight_packed")] for n in src if n.endswith(".weight_packed")]
    for base in pairs:
        assert torch.equal(out[base + ".weight"], src[base + ".weight_packed"]), base
        assert torch.equal(out[base + ".weight_scale"], src[base + ".weight_scale"]), base
        assert description[base + ".weight"] == "W4A8_MXFP"
    provenance = json.loads((tmp_path / "out" / "kimi_quant_provenance.json").read_text())
    assert provenance["source_packing"] == {"format": "compressed-tensors mxfp4-pack-quantized",
                                            "tensors": len(pairs), "copied": len(pairs), "decoded": {}}
    assert f"{len(pairs)} copied as they are" in (tmp_path / "out" / "README.md").read_text()
    _convert(decoded, tmp_path / "detour", "-t", "950dt")
    detour = _tensors(tmp_path / "detour", "quant_model_weights")
    for base in pairs:
        np.testing.assert_array_equal(
            decode_mxfp4(detour[base + ".weight"].numpy(), detour[base + ".weight_scale"].numpy()),
            decode_mxfp4(out[base + ".weight"].numpy(), out[base + ".weight_scale"].numpy()))
    # everything that is not a routed expert is the same conversion either way
    for name, t in out.items():
        if not any(name.startswith(b + ".") for b in pairs):
            assert torch.equal(t, detour[name]), name


def test_a3_from_the_release_equals_a3_from_its_exact_decoding(released, decoded, tmp_path):
    """The int4 rules take the exact decoded values: the release and its BF16 decoding give the same bytes."""
    _convert(released, tmp_path / "a", "-t", "a3", "--group-size", "32")
    _convert(decoded, tmp_path / "b", "-t", "a3", "--group-size", "32")
    a, b = _tensors(tmp_path / "a", "quant_model_weights"), _tensors(tmp_path / "b", "quant_model_weights")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    description = "quant_model_description.json"  # the same types (tensor order follows each source's shards)
    assert json.loads((tmp_path / "a" / description).read_text()) == \
        json.loads((tmp_path / "b" / description).read_text())


def test_a3_default_holds_the_mxfp4_experts_exactly_in_int8(released, tmp_path):
    """a3 from MXFP4 experts: by default W8A8_DYNAMIC with power-of-two row scales, which holds every row of
    the tiny model's experts exactly (a row whose block exponents span more than int8 can hold would not be)."""
    r = _convert(released, tmp_path / "out", "-t", "a3")
    from kimi_quant.mxfp4_a3 import experts_line

    line = experts_line("W8A8_DYNAMIC", 0, True, False)  # the measured rule and its cost: convert and the card
    assert line in r.stdout
    assert f"| a3 from MXFP4 | {line.removeprefix('a3 from MXFP4 experts: ')} |" in \
        (tmp_path / "out" / "README.md").read_text()
    src, out = _tensors(released, "model"), _tensors(tmp_path / "out", "quant_model_weights")
    description = json.loads((tmp_path / "out" / "quant_model_description.json").read_text())
    for name in [n for n in src if n.endswith(".weight_packed")]:
        base = name[: -len(".weight_packed")]
        assert description[base + ".weight"] == "W8A8_DYNAMIC"
        scale = out[base + ".weight_scale"].numpy()
        assert np.all(np.frexp(scale)[0] == 0.5)  # powers of two
        np.testing.assert_array_equal(out[base + ".weight"].numpy().astype(np.float32) * scale,
                                      decode_mxfp4(src[name].numpy(), src[base + ".weight_scale"].numpy()))
    provenance = json.loads((tmp_path / "out" / "kimi_quant_provenance.json").read_text())
    assert list(provenance["source_packing"]["decoded"]) == [
        "W8A8_DYNAMIC (power-of-two row scales: the MXFP4 values held exactly in int8 where a row allows)"]


def test_a3_per_channel_data_free_int4_is_refused_on_mxfp4_experts(released, tmp_path):
    """Asked for by name (the default takes int8), per-channel data-free int4 of MXFP4 experts is refused."""
    out = tmp_path / "out"
    r = kq("convert", str(released), "-t", "a3", "-o", str(out),
           "--override", "*.block_sparse_moe.experts.*=W4A8_DYNAMIC")
    assert r.returncode != 0
    line = error_line(r.stderr)
    assert "MXFP4" in line and "--calibrate" in line and "--group-size 32" in line
    assert not out.exists()


def test_validate_reads_the_release_as_its_reference(released, decoded, tmp_path):
    """Validation against the release decodes its experts exactly: the same perplexities as against the
    BF16 decoding."""
    reports = []
    for ref in (released, decoded):
        _convert(ref, tmp_path / ref.name, "-t", "950dt")
        r = kq("validate", str(ref), str(tmp_path / ref.name), "--json", str(tmp_path / f"{ref.name}.json"))
        assert r.returncode == 0, r.stderr
        reports.append(json.loads((tmp_path / f"{ref.name}.json").read_text()))
    a, b = reports
    assert a["ppl_bf16"] == b["ppl_bf16"] and a["ppl_quant"] == b["ppl_quant"]
    assert a["output_source_packing"]["copied"] == 240 and b["output_source_packing"] is None


def test_synth_writes_the_released_layout_that_compressed_tensors_reads(tmp_path):
    """``synth --experts mxfp4``: experts stored as compressed-tensors stores them (it decodes them to our
    values), a config it parses, and a checkpoint kimi-quant converts to 950dt byte for byte."""
    src = tmp_path / "rel"
    r = kq("synth", "--preset", "tiny", "--experts", "mxfp4", "-o", str(src))
    assert r.returncode == 0, r.stderr
    config = json.loads((src / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    assert qc.format == "mxfp4-pack-quantized"
    tensors = _tensors(src, "model")
    bf16 = synth("tiny", tmp_path / "bf16")
    plain = _tensors(bf16, "model")
    from kimi_quant.quant import get_codec

    codec = get_codec("W4A8_MXFP")
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        base = name[: -len("_packed")]
        values = ct_unpack(tensors[name], tensors[base + "_scale"]).float().numpy()
        w = plain[base].view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(values, codec.dequantize(codec.quantize_bf16(w)))


# -- bad input: one line, nothing written ----------------------------------------------------------------

def _damaged(bf16: Path, tmp_path: Path, edit) -> Path:
    return write_released(bf16, tmp_path / "src", edit)


def _first_pair(shards):
    for tensors in shards.values():
        for name in tensors:
            if name.endswith(".weight_packed"):
                return tensors, name[: -len("_packed")]


def _drop_scale(shards, config):
    tensors, base = _first_pair(shards)
    del tensors[base + "_scale"]


def _bad_scale_shape(shards, config):
    tensors, base = _first_pair(shards)
    tensors[base + "_scale"] = tensors[base + "_scale"][:, :1].contiguous()


def _nvfp4_format(shards, config):
    config["quantization_config"]["format"] = "nvfp4-pack-quantized"


def _int4_format(shards, config):
    config["quantization_config"]["format"] = "pack-quantized"


def _fp8_method(shards, config):
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}


def _no_config(shards, config):
    del config["quantization_config"]


def _scale_without_codes(shards, config):
    tensors, base = _first_pair(shards)
    del tensors[base + "_packed"]


@pytest.mark.parametrize("edit, words", [
    (_drop_scale, "needs its E8M0 scales"),
    (_bad_scale_shape, "MXFP4 scales are U8"),
    (_nvfp4_format, "'nvfp4-pack-quantized' is not supported"),
    (_int4_format, "'pack-quantized' is not supported"),
    (_fp8_method, "packed by quant_method 'fp8'"),
    (_no_config, "no quantization_config"),
    (_scale_without_codes, "holds scales but there is no"),
])
def test_bad_packed_sources_get_one_line_and_nothing_written(bf16, tmp_path, edit, words):
    src = _damaged(bf16, tmp_path, edit)
    out = tmp_path / "out"
    r = kq("convert", str(src), "-t", "950dt", "-o", str(out))
    assert r.returncode != 0
    assert words in error_line(r.stderr)
    assert not out.exists()


def test_config_naming_packing_the_index_lacks(bf16, tmp_path):
    """A BF16 checkpoint whose config claims mxfp4-pack-quantized: refused, not converted as BF16."""
    src = tmp_path / "src"
    shutil.copytree(bf16, src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": SCHEME}, format="mxfp4-pack-quantized").to_dict()
    (src / "config.json").write_text(json.dumps(config))
    r = kq("plan", str(src), "-t", "950dt")
    assert r.returncode != 0 and "holds no '.weight_packed' tensor" in error_line(r.stderr)


def test_a_nan_scale_is_refused_and_leaves_nothing_that_looks_complete(bf16, tmp_path):
    def nan_scale(shards, config):
        tensors, base = _first_pair(shards)
        tensors[base + "_scale"][0, 0] = 0xFF

    src = _damaged(bf16, tmp_path, nan_scale)
    out = tmp_path / "out"
    r = kq("convert", str(src), "-t", "950dt", "-o", str(out))
    assert r.returncode != 0 and "0xFF, E8M0's NaN" in error_line(r.stderr)
    assert not (out / "quant_model_description.json").exists()


def test_bf16_decoding_is_exact_for_every_byte_under_every_scale():
    """The int4 path's fast decoding (bf16 bits) equals the exact float decoding, rounded to bf16 (which
    holds every MXFP4 value), for all 256 code pairs under all 255 E8M0 scales."""
    from kimi_quant.dtypes import f32_to_bf16
    from kimi_quant.quant import decode_mxfp4_bf16

    codes = np.tile(np.arange(256, dtype=np.uint8), (255, 16))
    scales = np.repeat(np.arange(255, dtype=np.uint8)[:, None], 16 * 256 * 2 // 32, axis=1)
    normal = slice(2, 253)  # rows whose scales take the fast path (the others, the exact one)
    with np.errstate(over="ignore"):
        for rows in (normal, slice(None)):
            np.testing.assert_array_equal(decode_mxfp4_bf16(codes[rows], scales[rows]),
                                          f32_to_bf16(decode_mxfp4(codes[rows], scales[rows])))


def test_calibrated_a3_from_the_release_equals_it_from_the_decoding(released, decoded, tmp_path):
    """--calibrate reads the release through the same exact decoding: the forward, the Hessians and GPTQ
    see the same values, so the bytes are those of a calibrated run from the BF16 decoding."""
    opts = ("-t", "a3", "--calibrate", "--calib-tokens", "512")
    _convert(released, tmp_path / "a", *opts)
    _convert(decoded, tmp_path / "b", *opts)
    a, b = _tensors(tmp_path / "a", "quant_model_weights"), _tensors(tmp_path / "b", "quant_model_weights")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_calibrated_a3_never_routed_mxfp4_experts_get_gptq_from_every_token(bf16, tmp_path, monkeypatch):
    """Released layout, two experts of one layer that the router can never choose: the plan made every expert of
    the layer int4 per channel (one type per fused MoE layer), whose data-free rule breaks MXFP4 values, so they
    get GPTQ (power-of-two candidates) on the inputs every calibration token gives them, and the stats say so."""
    from kimi_quant.calibrate import CalibConfig
    from kimi_quant.calibrate import jobs as calib_jobs
    from kimi_quant.calibrate import run as calib_run
    from kimi_quant.convert import ConvertOptions, convert
    from kimi_quant.layout.model_card import describe_calibration
    from kimi_quant.quant import get_codec
    from kimi_quant.quant.gptq import for_mxfp4_weights
    from kimi_quant.runtime.weights import QuantizedLoader, SourceLoader

    layer, never = 2, (7, 9)
    bias = f"language_model.model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias"

    def unroutable(shards, config):
        for tensors in shards.values():
            if bias in tensors:
                tensors[bias] = tensors[bias].clone()
                tensors[bias][list(never)] = -1e4  # never in a top-k
    src = write_released(bf16, tmp_path / "src", unroutable)
    jobs, hessians = {}, {}
    run_expert_job = calib_jobs.run_expert_job

    def recorded(job):  # each expert's GPTQ problems, and the Hessians its job forms from its token rows
        h_in, h_mid = job.hessians()
        for j in job.jobs:
            jobs[j.name] = replace(j, hessian=h_mid if j.matmul == "down" else h_in)
        hessians[job.name] = (h_in, h_mid)
        return run_expert_job(job)
    monkeypatch.setattr(calib_jobs, "run_expert_job", recorded)
    out = tmp_path / "out"
    res = convert(str(src), ConvertOptions(target="a3", output=out, quiet=True, workers=1,
                                           calibrate=CalibConfig(tokens=512)))
    s = res.calibration["stats"]
    assert s["never_routed_experts"] == 2 and s["all_token_experts"] >= 2
    assert s["all_token_experts"] == s["never_routed_experts"] + s["fallback_experts"]
    assert f"{s['all_token_experts']} of them, holding MXFP4 values, were calibrated on every" \
        in describe_calibration(res.calibration)
    E = f"language_model.model.layers.{layer}.block_sparse_moe.experts."
    with SourceLoader(src) as sl, QuantizedLoader(out) as ql:
        for e in never:
            for w in ("w1", "w2", "w3"):
                name = f"{E}{e}.{w}.weight"
                job = jobs[name]  # GPTQ, not the data-free rule, and the candidates for MXFP4 values
                assert job.scheme == "W4A8_DYNAMIC" and not job.group_size
                assert job.config == for_mxfp4_weights(calib_run.gptq_config(CalibConfig(tokens=512)))
                written = ql.tensor(name)[0]
                assert torch.equal(written, torch.from_numpy(get_codec("W4A8_DYNAMIC").dequantize(
                    calib_jobs.run_gptq_job(job))).to(written.dtype))
                data_free = get_codec("W4A8_DYNAMIC").quantize(sl.tensor(name)[0].numpy(), job.matmul)
                assert not torch.equal(written, torch.from_numpy(get_codec("W4A8_DYNAMIC").dequantize(data_free)))
    # the same tokens reach both experts: w1 (and w3) see one input statistic, w2 each its own
    assert np.array_equal(hessians[f"{E}7"][0], hessians[f"{E}9"][0])
    assert jobs[f"{E}7.w1.weight"].hessian is jobs[f"{E}7.w3.weight"].hessian
    assert not np.array_equal(hessians[f"{E}7"][1], hessians[f"{E}9"][1])
