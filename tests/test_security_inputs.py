"""Issue 31, class 8: hostile tokenizer and calibration files give one line (a refusal, or a warning and
the defaults), never a traceback or a hang."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import error_line, kq  # noqa: E402

from kimi_quant.synth import synth  # noqa: E402
from kimi_quant.runtime.tokenizer import NUM_SPECIAL, load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return synth("tiny", tmp_path_factory.mktemp("inputs") / "tiny-bf16")


@pytest.fixture
def src(source, tmp_path) -> Path:
    d = tmp_path / "src"
    shutil.copytree(source, d)
    return d


def _tiktoken_line(src: Path, n: int, new: bytes) -> None:
    p = src / "tiktoken.model"
    lines = p.read_bytes().splitlines()
    lines[n] = new.replace(b"TOK", lines[n].split()[0])
    p.write_bytes(b"\n".join(lines) + b"\n")


@pytest.mark.parametrize("line", [b"TOK -7", b"TOK 99999999999999999999", b"TOK 1.5", b"!!notbase64!! 3", b"TOK 3"])
def test_a_bad_tiktoken_rank_is_one_line(src, tmp_path, line):
    _tiktoken_line(src, 5, line)
    r = kq("convert", src, "-t", "a3", "-o", tmp_path / "out", "--calibrate", "-q")
    msg = error_line(r.stderr)
    assert r.returncode == 2 and "tiktoken.model" in msg, msg
    assert not (tmp_path / "out" / "quant_model_description.json").exists()


@pytest.mark.parametrize("config, why", [
    ("{\"added_tokens_decoder\": " + "[" * 100000 + "]" * 100000 + "}", "nested too deeply"),
    (b"{\"added_tokens_decoder\": \"\xff\"}", "utf-8"),
    ('{"added_tokens_decoder": [1, 2]}', "not an object"),
    ('"just a string"', "object has no attribute"),
])
def test_a_malformed_tokenizer_config_gives_the_default_names_with_one_warning(src, caplog, config, why):
    (src / "tokenizer_config.json").write_bytes(config if isinstance(config, bytes) else config.encode())
    with caplog.at_level(logging.WARNING):
        tok = load_tokenizer(src)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "tokenizer_config.json ignored" in warned[0] and why in warned[0].lower(), warned
    assert tok.vocab_size == tok.n_ranks + NUM_SPECIAL


def test_non_string_special_names_are_skipped(src):
    n = max(load_tokenizer(src).special.values()) - NUM_SPECIAL + 1
    added = {str(n): {"content": 5}, str(n + 1): {"content": ["x"]}, str(n + 2): {"content": "[EOS]"},
             str(n + 3): {"content": "[EOS]"}, "not-an-id": {"content": "<x>"}, str(n + 4): None}
    (src / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    tok = load_tokenizer(src)
    assert tok.vocab_size == tok.n_ranks + NUM_SPECIAL  # every special keeps an id of its own
    assert tok.special["[EOS]"] == n + 2 and "<x>" not in tok.special


@pytest.mark.parametrize("name, data, why", [
    ("deep.jsonl", b'{"text": "abc"}\n{"text": ' + b"[" * 100000 + b"]" * 100000 + b"}\n", "deep.jsonl:2: nested too"),
    ("bad.jsonl", b'{"text": "\xff\xfe abc"}\n', "bad.jsonl:1: not UTF-8"),
    ("bad.txt", b"some text \xff\xfe", "bad.txt: not UTF-8"),
])
def test_a_hostile_calibration_file_is_one_line(source, tmp_path, name, data, why):
    f = tmp_path / name
    f.write_bytes(data)
    r = kq("convert", source, "-t", "a3", "-o", tmp_path / "out", "--calibrate", "--calibration", f, "-q", timeout=120)
    assert r.returncode == 2 and why in error_line(r.stderr)
