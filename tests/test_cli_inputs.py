"""Bad command-line input, bad config/recipe files and unwritable paths: each is refused with one line
``kimi-quant: error: ...`` on stderr, exit code 2, before anything that looks complete is written."""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest

from conftest import error_line, kq

ROOT = Path(__file__).resolve().parents[1]


def refused(*args, out: Path | None = None) -> str:
    r = kq(*args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "", r.stdout
    if out is not None:
        assert not out.exists(), sorted(p.name for p in out.iterdir())
    return error_line(r.stderr)


# -- 1. a scheme from the other device family ---------------------------------------------------------
@pytest.mark.parametrize("target,override,scheme", [("a3", "*lm_head*=W4A8_MXFP", "W4A8_MXFP"),
                                                    ("950dt", "*.layers.0.mlp.*=W8A8_DYNAMIC", "W8A8_DYNAMIC")])
def test_scheme_of_the_other_family_refused(tiny_source, tmp_path, target, override, scheme):
    out = tmp_path / "out"
    line = refused("convert", tiny_source, "-t", target, "--override", override, "-o", out, out=out)
    assert line == (f"kimi-quant: error: --override {override!r}: scheme {scheme} is not for target {target} "
                    f"(it takes {'FLOAT, W4A8_DYNAMIC, W8A8_DYNAMIC' if target == 'a3' else 'FLOAT, W4A8_MXFP, W8A8_MXFP8'})")


def test_recipe_role_with_the_other_family_refused(tiny_source, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[targets.a3]\ndefault = "FLOAT"\n[targets.a3.roles]\n"routed_expert.*" = "W4A8_MXFP"\n')
    line = refused("plan", tiny_source, "-t", "a3", "--recipe", recipe)
    assert line.startswith(f"kimi-quant: error: {recipe} [targets.a3.roles] routed_expert.*: scheme W4A8_MXFP "
                           "is not for target a3"), line


# -- 2. OSError: one line naming the path --------------------------------------------------------------
def test_output_under_a_file(tiny_source, tmp_path):
    (tmp_path / "afile").write_text("x")
    line = refused("convert", tiny_source, "-t", "a3", "-o", tmp_path / "afile" / "sub")
    assert line == f"kimi-quant: error: {tmp_path / 'afile' / 'sub'}: Not a directory"
    assert (tmp_path / "afile").read_text() == "x"


def test_output_under_a_missing_proc_dir(tiny_source):
    line = refused("convert", tiny_source, "-t", "a3", "-o", "/proc/kq-no-such/out")
    assert line.startswith("kimi-quant: error: /proc/kq-no-such") and line.endswith(": No such file or directory")


def test_synth_output_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    line = refused("synth", "-o", tmp_path / "afile" / "sub")
    assert line == f"kimi-quant: error: {tmp_path / 'afile' / 'sub'}: Not a directory"


def test_plan_json_unwritable_fails_before_printing(tiny_source, tmp_path):
    target = tmp_path / "nodir" / "plan.json"
    line = refused("plan", tiny_source, "-t", "a3", "--json", target)  # refused() checks stdout is empty
    assert line == f"kimi-quant: error: {target}: cannot write the plan (No such file or directory)"
    ok = kq("plan", tiny_source, "-t", "a3", "--no-shards", "--json", tmp_path / "plan.json")
    assert ok.returncode == 0 and json.loads((tmp_path / "plan.json").read_text())["target"] == "a3"


def test_debug_shows_the_traceback(tiny_source, tmp_path):
    r = kq("--debug", "convert", tiny_source, "-t", "a3", "-o", "/proc/kq-no-such/out")
    assert r.returncode == 2
    assert "Traceback" in r.stderr and "FileNotFoundError" in r.stderr
    assert r.stderr.splitlines()[-1].startswith("kimi-quant: error: /proc/kq-no-such")


# -- 3. config.json and recipe files of the wrong shape ------------------------------------------------
def _source_with_config(tiny_source, tmp_path, text: str) -> Path:
    src = tmp_path / "src"
    shutil.copytree(tiny_source, src)
    (src / "config.json").write_text(text)
    return src


@pytest.mark.parametrize("config,message", [
    ("[1, 2]", "expected a JSON object, got a list"),
    ('{"model_type": "kimi_k3"}', "model_type 'kimi_k3' needs a 'text_config' object, got None"),
    ('{"model_type": "kimi_k3", "text_config": null}', "model_type 'kimi_k3' needs a 'text_config' object, got None"),
    ('{"model_type": "kimi_k3", "text_config": [1]}', "model_type 'kimi_k3' needs a 'text_config' object, got [1]"),
])
def test_config_of_the_wrong_shape(tiny_source, tmp_path, config, message):
    src = _source_with_config(tiny_source, tmp_path, config)
    line = refused("plan", src, "-t", "a3")
    assert line == f"kimi-quant: error: {src}/config.json: {message}"


@pytest.mark.parametrize("text,message", [
    ("targets = 3\n", "'targets' must be a table, got int 3"),
    ("[targets.a3]\nroles = 5\n", "[targets.a3.roles] must be a table, got int 5"),
    ("[targets.a3]\nrules = 'x'\n", "[[targets.a3.rules]] must be an array of tables, got str 'x'"),
])
def test_recipe_of_the_wrong_shape(tiny_source, tmp_path, text, message):
    recipe = tmp_path / "r.toml"
    recipe.write_text(text)
    assert refused("plan", tiny_source, "-t", "a3", "--recipe", recipe) == f"kimi-quant: error: {recipe}: {message}"


def test_recipe_not_utf8(tiny_source, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_bytes(b'name = "\xff"\n')
    line = refused("plan", tiny_source, "-t", "a3", "--recipe", recipe)
    assert line == f"kimi-quant: error: {recipe}: not a TOML recipe (not UTF-8 text: byte 8)"


def test_recipe_unknown_role_key(tiny_source, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[targets.a3]\n[targets.a3.roles]\n"routed_exprt.*" = "W4A8_DYNAMIC"\n')
    line = refused("plan", tiny_source, "-t", "a3", "--recipe", recipe)
    assert line.startswith(f"kimi-quant: error: {recipe}: [targets.a3.roles] 'routed_exprt.*' names no role; "
                           "known roles: "), line
    assert "routed_expert.gate" in line and "lm_head" in line


# -- 4. an override that matches nothing ---------------------------------------------------------------
def test_override_matching_nothing(tiny_source, tmp_path):
    out = tmp_path / "out"
    line = refused("convert", tiny_source, "-t", "a3", "--override", "nomatch.*=FLOAT", "-o", out, out=out)
    assert line == ("kimi-quant: error: --override 'nomatch.*=FLOAT': the pattern matches no tensor "
                    "(names look like 'language_model.lm_head.weight')")


# -- 5. sizes and worker counts --------------------------------------------------------------------------
@pytest.mark.parametrize("size", ["0", "1KB", "65535"])
def test_max_shard_size_below_minimum(tiny_source, size):
    line = refused("plan", tiny_source, "-t", "a3", "--max-shard-size", size)
    assert line.startswith(f"kimi-quant: error: Invalid value for '--max-shard-size': '{size}' is below the "
                           "minimum of 65,536 bytes"), line


def test_max_shard_size_minimum_accepted(tiny_source):
    r = kq("plan", tiny_source, "-t", "a3", "--max-shard-size", "64KiB", "--no-shards")
    assert r.returncode == 0, r.stderr
    assert "(max 0.07 MB)" in r.stdout


@pytest.mark.parametrize("command", ["plan", "convert"])
@pytest.mark.parametrize("workers", ["0", "-1"])
def test_workers_below_one(tiny_source, tmp_path, command, workers):
    out = tmp_path / "out"
    extra = ["-o", out] if command == "convert" else []
    line = refused(command, tiny_source, "-t", "a3", "--workers", workers, *extra, out=out)
    assert line.startswith(f"kimi-quant: error: Invalid value for '--workers': {workers} is not in the range x>=1"), line


# -- 6. validate: same error path as the other commands, and it verifies the output first ----------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The trained tiny fixture (validate needs its tokenizer) converted for 950dt."""
    d = tmp_path_factory.mktemp("val")
    assert kq("synth", "-o", d / "src").returncode == 0
    r = kq("convert", d / "src", "-t", "950dt", "-o", d / "out", "-q", "--max-shard-size", "1MB", "--workers", "1")
    assert r.returncode == 0, r.stderr
    return d / "src", d / "out"


def test_validate_ok_with_short_quiet_flag(converted):
    src, out = converted
    r = kq("validate", src, out, "-q", "--max-tokens", "300", "--seq-len", "150")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert re.search(r"ratio \d\.\d{4}", r.stdout)


def test_validate_refuses_a_damaged_shard(converted, tmp_path):
    src, out = converted
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    shard = sorted(bad.glob("quant_model_weights-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 1
    shard.write_bytes(bytes(data))
    line = refused("validate", src, bad, "-q")
    assert line == (f"kimi-quant: error: {bad}: verify failed: {shard.name}: sha256 differs from the journal "
                    "(file damaged or modified)")
    r = kq("--debug", "validate", src, bad, "-q")
    assert r.returncode == 2 and "Traceback" in r.stderr and "KimiQuantError" in r.stderr
    assert r.stderr.splitlines()[-1] == line


def test_validate_errors_are_one_line_exit_2(converted, tmp_path):
    src, _ = converted
    # run_validation's own error (a BF16 dir is not an ascendV1 output)
    line = refused("validate", src, src, "-q")
    assert "quant_model_description.json" in line
    # click's argument checks take the same path
    line = refused("validate", src, tmp_path / "missing")
    assert line.startswith("kimi-quant: error: Invalid value for 'QUANTIZED': Directory ") and "missing" in line


# -- 7. synth -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", ["0", "-2"])
def test_synth_num_experts_below_one(tmp_path, n):
    out = tmp_path / "s"
    line = refused("synth", "--num-experts", n, "-o", out, out=out)
    assert line.startswith(f"kimi-quant: error: Invalid value for '--num-experts': {n} is not in the range x>=1")


def test_synth_refuses_a_non_empty_dir_and_overwrite_replaces(tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    (out / "keep.txt").write_text("mine")
    line = refused("synth", "-o", out)
    assert line == (f"kimi-quant: error: {out} is not empty (it holds 'config.json' and more); choose another "
                    "--output, or pass --overwrite to replace the checkpoint there")
    assert (out / "config.json").read_text() == "{}"
    r = kq("synth", "-o", out, "--overwrite", "--num-experts", "5")
    assert r.returncode == 0, r.stderr
    assert not (out / "model-00009-of-00009.safetensors").exists()
    assert (out / "keep.txt").read_text() == "mine"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("model-*.safetensors")}
    assert json.loads((out / "config.json").read_text())["text_config"]["num_experts"] == 5


def test_synth_help_texts():
    text = " ".join(kq("synth", "--help").stdout.split())
    for opt, words in (("-o, --output DIRECTORY", "Directory to write"), ("--seed INTEGER", "Seed of the random"),
                       ("--num-experts INTEGER RANGE", "Routed experts per MoE layer"),
                       ("--overwrite", "Write into a non-empty directory")):
        assert f"{opt} {words}" in text, opt


# -- 8. size units in help ------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["convert", "plan", "synth"])
def test_size_units_explained(command):
    text = " ".join(kq(command, "--help").stdout.split())
    assert "GB = 10^3/10^6/10^9 bytes" in text and "GiB = 2^10/2^20/2^30" in text


# -- 9, 10. packaging and README claims ------------------------------------------------------------------
def test_requires_python_has_tomllib():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["requires-python"] == ">=3.11"  # recipe.py imports tomllib (3.11+)


def test_readme_full_inventory_command_gives_what_it_claims(tmp_path):
    readme = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"\(([\d,]+) tensors in ([\d,]+) shards, `kimi-quant (synth [^`]+)`", readme)
    assert m, "README no longer states the full-inventory command"
    tensors, shards, command = int(m[1].replace(",", "")), int(m[2].replace(",", "")), m[3].split()
    assert kq(*command, "-o", tmp_path / "full").returncode == 0
    index = json.loads((tmp_path / "full" / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == tensors
    assert len(set(index["weight_map"].values())) == shards == len(list((tmp_path / "full").glob("*.safetensors")))
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme


# -- a perplexity bound that fails is its own exit code ---------------------------------------------
def test_failed_perplexity_bound_exits_3_and_marks_the_provenance(tmp_path):
    out = tmp_path / "out"
    fixture = ROOT / "kimi_quant" / "model" / "fixtures" / "tiny"  # the trained model, with its tokenizer
    r = kq("convert", fixture, "-t", "a3", "-o", out, "--max-shard-size", "1MB", "-q",
           "--validate", "--max-ppl-increase", "-50")  # a bound no quantized model meets
    assert r.returncode == 3, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"kimi-quant: error: validation failed: perplexity rose -?\d+\.\d+% over BF16 "
                        r"\(\d+\.\d+ -> \d+\.\d+\), above the bound of -50\.0%; the output stays in .*, "
                        r"marked as failing \(verify fails, publish refuses it\)", line), r.stderr
    prov = json.loads((out / "kimi_quant_provenance.json").read_text())
    assert prov["validation"]["passed"] is False and prov["validation"]["max_ppl_increase_pct"] == -50.0


def test_synth_refuses_fewer_experts_than_a_token_is_routed_to(tmp_path):
    out = tmp_path / "b"
    line = refused("synth", "--preset", "bench", "--num-experts", "2", "-o", out, out=out)
    assert line == ("kimi-quant: error: --num-experts 2: preset bench routes each token to 4 experts, "
                    "so it needs at least that many")


# -- validate against the wrong source ------------------------------------------------------------
def test_validate_refuses_a_source_that_is_not_the_outputs_and_warns_on_an_implausible_ratio(tmp_path):
    fixture = ROOT / "kimi_quant" / "model" / "fixtures" / "tiny"
    out = tmp_path / "out"
    assert kq("convert", fixture, "-t", "a3", "-o", out, "-q").returncode == 0
    other = tmp_path / "other"
    shutil.copytree(fixture, other)
    with open(other / "model.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    line = refused("validate", other, out, "-q")
    assert line == (f"kimi-quant: error: {other}/model.safetensors has {(fixture / 'model.safetensors').stat().st_size + 8} "
                    f"bytes, the output was made from {(fixture / 'model.safetensors').stat().st_size} "
                    f"({out}/kimi_quant_provenance.json): validate against the checkpoint the output was converted from "
                    "(--force shows the numbers without recording them)")
    zeroed = tmp_path / "zeroed"  # same files and sizes, other weights (no sha256 recorded to tell them apart)
    shutil.copytree(fixture, zeroed)
    from kimi_quant.source.safetensors import read_header

    emb = next(t for n, t in read_header(zeroed / "model.safetensors")[0].items() if "embed_tokens" in n)
    data = bytearray((zeroed / "model.safetensors").read_bytes())
    data[emb.start:emb.end] = bytes(emb.end - emb.start)
    (zeroed / "model.safetensors").write_bytes(bytes(data))
    # the first layer disagrees: refused (nothing recorded), unless --force, which shows the numbers and warns
    line = refused("validate", zeroed, out, "-q")
    assert "the source given is not the checkpoint the output was converted from" in line and "--force" in line
    r = kq("validate", zeroed, out, "-q", "--force")
    assert r.returncode == 0, r.stderr
    assert re.search(rf"kimi-quant: warning: a perplexity ratio of 0\.\d+ is implausible for a faithful "
                     rf"quantization: is {re.escape(str(zeroed))} the checkpoint", r.stderr), r.stderr


def test_cli_imports_nothing_heavy():
    """`kimi-quant convert` starts its workers' fork server (about a second of one core: numba, the
    kernels) before the driver imports numpy and plans; that is only a head start while the CLI module
    itself imports none of numpy, numba, torch or the hub client."""
    import subprocess
    import sys

    code = ("import sys, kimi_quant.cli; "
            "print(sorted(m for m in ('numpy', 'numba', 'torch', 'huggingface_hub') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
