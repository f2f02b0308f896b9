"""Tokenizer (the checkpoint's own tiktoken.model) and calibration loaders."""

import json
from pathlib import Path

import pytest
import regex

from kimi_quant.errors import KimiQuantError
from kimi_quant.runtime.text import CALIBRATION_DIR, load_texts
from kimi_quant.runtime.tokenizer import KIMI_PATTERN, load_tokenizer, read_ranks, train_bpe, write_ranks, Tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "kimi_quant" / "model" / "fixtures" / "tiny"


def test_fixture_tokenizer_roundtrip_and_vocab():
    tok = load_tokenizer(FIXTURE)
    assert tok.n_ranks == 768 and tok.vocab_size == 1024
    assert tok.bos_id == 768 and tok.eos_id == 769
    for s in ["def f(x):\n    return x + 1\n", "小明有12个苹果。", "Hello, World! don't 123456", "<|im_end|> é ü"]:
        ids = tok.encode(s)
        assert max(ids) < 768  # plain text never yields specials
        assert tok.decode(ids) == s


def test_pretokenizer_splits_han_runs():
    pieces = regex.findall(KIMI_PATTERN, "Hello 你好世界abc 123456 DON'T x=1\n\n  y")
    assert "你好世界" in pieces and "abc" in pieces
    assert "123" in pieces and "456" in pieces
    assert " DON'T" in pieces and "\n\n" in pieces


def test_specials_named_from_tokenizer_config():
    tok = load_tokenizer(FIXTURE)
    assert tok.special["[EOS]"] == 769
    assert len(tok.special) == 256
    assert tok.enc.encode("<|im_end|>", allowed_special="all") == [tok.special["<|im_end|>"]]


def test_missing_tiktoken_model(tmp_path):
    with pytest.raises(KimiQuantError, match="no tiktoken.model found"):
        load_tokenizer(tmp_path)


def test_bad_tiktoken_line(tmp_path):
    (tmp_path / "tiktoken.model").write_text("not-a-valid-line\n")
    with pytest.raises(KimiQuantError, match="tiktoken.model:1"):
        load_tokenizer(tmp_path)


def test_bpe_trainer_deterministic_roundtrip(tmp_path):
    texts = ["the cat sat on the mat", "the cat ate the rat", "猫坐在垫子上"] * 5
    r1, r2 = train_bpe(texts, 280), train_bpe(texts, 280)
    assert r1 == r2 and len(r1) == 280 and sorted(r1.values()) == list(range(280))
    write_ranks(tmp_path / "tiktoken.model", r1)
    assert read_ranks(tmp_path / "tiktoken.model") == r1
    tok = Tokenizer(r1)
    assert len(tok.encode("the cat")) < len("the cat".encode())
    assert tok.decode(tok.encode("猫坐在垫子上 the rat")) == "猫坐在垫子上 the rat"


def test_shipped_calibration_splits():
    train, held = load_texts("builtin:train"), load_texts("builtin:heldout")
    assert len(train) > 500 and len(held) > 50
    assert not set(train) & set(held)
    assert load_texts(None) == held
    assert any("def " in t for t in held) and any(regex.search(r"\p{Han}", t) for t in held)
    size = sum(p.stat().st_size for p in CALIBRATION_DIR.glob("*.jsonl"))
    assert size < 1_000_000


def test_user_files(tmp_path):
    j = tmp_path / "c.jsonl"
    j.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert load_texts(j) == ["one", "two"]
    t = tmp_path / "c.txt"
    t.write_text("hello world")
    assert load_texts(str(t)) == ["hello world"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "x"}\n')
    with pytest.raises(KimiQuantError, match="bad.jsonl:1: .*'text'"):
        load_texts(bad)
    with pytest.raises(KimiQuantError, match="not found"):
        load_texts(tmp_path / "missing.jsonl")


def test_parquet(tmp_path):
    p = tmp_path / "c.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        p.write_bytes(b"PAR1")
        with pytest.raises(KimiQuantError, match="pyarrow"):
            load_texts(p)
        return
    pq.write_table(pa.table({"text": ["a", "b"]}), p)
    assert load_texts(p) == ["a", "b"]


def test_hub_name_offline_is_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(KimiQuantError, match="calibration"):
        load_texts("someorg/some-dataset")


def test_fixture_matches_spec_and_preset():
    from kimi_quant.model.presets import preset_config
    from kimi_quant.model.spec import load_model_spec
    from kimi_quant.source.safetensors import read_header

    assert json.loads((FIXTURE / "config.json").read_text()) == preset_config("tiny")
    tensors, _ = read_header(FIXTURE / "model.safetensors")
    expected = load_model_spec(FIXTURE).expected_tensors()
    assert {n: (t.shape, t.dtype) for n, t in tensors.items()} == expected
    assert (FIXTURE / "model.safetensors").stat().st_size < 5_000_000
