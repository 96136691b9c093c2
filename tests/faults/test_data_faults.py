"""Faults of the data: bad files are named (with the line where there is one) and the fix;
corrupt caches are rebuilt with one line saying so. Each docstring quotes the line."""

from __future__ import annotations

import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import one_line

from llm.config import DataConfig
from llm.data import prepare_data
from llm.errors import DataError

# --- data --------------------------------------------------------------------------------


def files_config(path, tmp_path, tokenizer="byte") -> DataConfig:
    return DataConfig(
        name="files", path=str(path), cache_dir=str(tmp_path / "cache"), tokenizer=tokenizer
    )


def test_non_utf8_jsonl_line_is_named(tmp_path):
    """error: DIR/docs.jsonl:2 is not UTF-8 (byte 0xe9 at column 11); re-encode the file as
    UTF-8 or remove the line"""
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 latin-1"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:2 is not UTF-8 \(byte 0xe9") as err:
        prepare_data(files_config(path, tmp_path))
    assert "re-encode" in one_line(err)


def test_garbage_parquet_is_named(tmp_path):
    """error: DIR/rows.parquet is not a readable Parquet file (Parquet magic bytes not found
    ...); re-export it, or remove it from data.path"""
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": ["some text"] * 50}), good)
    (tmp_path / "rows.parquet").write_bytes(os.urandom(2048))
    with pytest.raises(DataError, match=r"rows\.parquet is not a readable Parquet file") as err:
        prepare_data(files_config(tmp_path, tmp_path))
    assert "re-export it" in one_line(err)


def test_malformed_tokenizer_json_is_named(tmp_path, text_corpus):
    """error: DIR/tokenizer.json is not a valid tokenizer.json (EOF while parsing ...); save
    it again with tokenizer.save_pretrained(DIR), or use data.tokenizer=bpe"""
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": {')
    with pytest.raises(DataError, match=r"tokenizer\.json is not a valid tokenizer\.json") as err:
        prepare_data(files_config(text_corpus, tmp_path, tokenizer=str(bad)))
    assert "save_pretrained" in one_line(err)


def test_binary_file_read_as_text_is_refused(tmp_path):
    """error: DIR/blob.txt is not UTF-8 text (N of M characters do not decode: binary, or
    another encoding); re-encode it as UTF-8 (iconv -t utf-8) or remove it from data.path"""
    (tmp_path / "notes.txt").write_text("plain text " * 100)
    (tmp_path / "blob.txt").write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(DataError, match=r"blob\.txt is not UTF-8 text") as err:
        prepare_data(files_config(tmp_path, tmp_path))
    assert "iconv" in one_line(err)


def test_corrupt_token_cache_is_rebuilt(tmp_path, text_corpus, caplog):
    """warning: token cache DIR is corrupt (train.offsets.npy does not match its xxh3_64
    checksum); rebuilding it"""
    cfg = files_config(text_corpus, tmp_path)
    first = np.asarray(prepare_data(cfg).train.tokens).copy()
    (offsets,) = (tmp_path / "cache").rglob("train.offsets.npy")
    data = bytearray(offsets.read_bytes())
    data[-8:] = b"\xff" * 8  # the last offset: same size, another value
    offsets.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        again = prepare_data(cfg)
    assert any(
        "is corrupt" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records
    )
    assert np.array_equal(np.asarray(again.train.tokens), first)
    assert again.train.offsets[-1] == len(first)


def test_corrupt_cached_tokenizer_is_trained_again(tmp_path, text_corpus, caplog):
    """warning: tokenizer cache DIR/bpe-....json is corrupt (...); training it again"""
    cfg = DataConfig(
        name="files",
        path=str(text_corpus),
        cache_dir=str(tmp_path / "cache"),
        vocab_size=300,
        tokenizer_train_bytes=50_000,
    )
    first = prepare_data(cfg).tokenizer
    (cached,) = (tmp_path / "cache" / "tokenizers").glob("*.json")
    cached.write_text(cached.read_text()[:100])
    with caplog.at_level(logging.WARNING):
        again = prepare_data(cfg).tokenizer
    assert any("training it again" in r.getMessage() for r in caplog.records)
    assert again.digest == first.digest
