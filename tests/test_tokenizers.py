"""Tokenizers: bytes, our BPE (trained once, then loaded from its cache), local HF tokenizers."""

from __future__ import annotations

import pytest

from llm.config import DataConfig
from llm.data import tokenizer as tokenizer_module
from llm.data.corpora import build_corpus
from llm.data.tokenizer import ByteTokenizer, build_tokenizer, train_bpe
from llm.errors import ConfigError, DataError

TEXT = "def f(x):\n    return x + 1  # héllo, wörld ✓ 日本\n"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture
def corpus_dir(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(12):
        body = "".join(
            f"def func_{i}_{j}(value):\n    return value * {j} + {i}\n\n" for j in range(40)
        )
        (root / f"mod_{i}.py").write_text(f'"""Module {i}: héllo ✓."""\n\n{body}')
    return root


def files_cfg(corpus_dir, tmp_path, **kw) -> DataConfig:
    return DataConfig(name="files", path=str(corpus_dir), cache_dir=str(tmp_path / "cache"), **kw)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert tok.vocab_size == 257 and tok.eos_id == 256
    assert max(ids) < 256 and len(ids) == len(TEXT.encode("utf-8"))
    assert tok.decode([*ids, tok.eos_id]) == TEXT  # eos decodes to nothing
    assert tok.encode_batch([TEXT, "a"]) == [ids, [97]]


def test_bpe_trains_round_trips_and_is_cached(corpus_dir, tmp_path, monkeypatch):
    cfg = files_cfg(corpus_dir, tmp_path, tokenizer="bpe", vocab_size=400)
    corpus = build_corpus(cfg)
    tok = build_tokenizer(cfg, corpus)
    assert 257 < tok.vocab_size <= 400
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert len(tok.encode("return value")) < len("return value")  # merges were learned
    assert tok.encode_batch([TEXT, "x"]) == [tok.encode(TEXT), tok.encode("x")]
    assert tok.decode([tok.eos_id]) == "<|endoftext|>"

    def no_training(*args, **kwargs):
        raise AssertionError("the cached BPE should have been loaded, not retrained")

    monkeypatch.setattr(tokenizer_module, "train_bpe", no_training)
    again = build_tokenizer(cfg, build_corpus(cfg))
    assert again.digest == tok.digest and again.encode(TEXT) == tok.encode(TEXT)
    # A different vocabulary is a different cache entry, so it must train.
    with pytest.raises(AssertionError, match="retrained"):
        build_tokenizer(files_cfg(corpus_dir, tmp_path, vocab_size=300), corpus)


def test_hf_tokenizer_from_local_folder_and_json(tmp_path):
    from transformers import PreTrainedTokenizerFast

    backend = train_bpe(iter([TEXT * 50, "hello world " * 100]), 300)
    saved = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(
        saved
    )
    cfg = DataConfig(tokenizer=str(saved), cache_dir=str(tmp_path / "cache"))
    tok = build_tokenizer(cfg, corpus=None)  # a given tokenizer never reads the corpus
    assert tok.eos_id == backend.token_to_id("<|endoftext|>")
    assert tok.vocab_size == backend.get_vocab_size()
    assert tok.decode(tok.encode(TEXT)) == TEXT
    as_json = build_tokenizer(
        DataConfig(tokenizer=str(saved / "tokenizer.json"), cache_dir=str(tmp_path)), corpus=None
    )
    assert as_json.encode(TEXT) == tok.encode(TEXT) and as_json.eos_id == tok.eos_id


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(ConfigError, match="is not byte, bpe or an existing"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "missing")), corpus=None)
    backend = train_bpe(iter(["hello world " * 100]), 300)
    backend.save(str(tmp_path / "tokenizer.json"))
    # Our BPE knows <|endoftext|>; strip it to check a tokenizer with no end-of-text token.
    text = (tmp_path / "tokenizer.json").read_text().replace("<|endoftext|>", "<|unused|>")
    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.raises(DataError, match="no end-of-text token"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "tokenizer.json")), corpus=None)
