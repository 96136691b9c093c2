"""Token caches: each split tokenised once into a flat memmap plus document offsets.

Layout under data.cache_dir: tokens/<corpus>-<corpus digest>-<tokenizer digest>/
<split>.bin (raw uint16 or uint32) and <split>.offsets.npy (int64, n_documents + 1). Both
files are written to unique temporary names and moved into place with os.replace, the
offsets last: they are the mark of a complete cache. Two processes preparing at once
write identical bytes, so whichever replace lands last leaves the same valid pair.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from llm.data.corpora import Corpus
from llm.data.dataset import TokenDataset
from llm.data.tokenizer import Tokenizer
from llm.errors import DataError

log = logging.getLogger(__name__)

FORMAT = "v1"  # bump when the layout or the document rules below change
BATCH_CHARS = 4_000_000  # text per encode_batch call: enough to keep every core busy


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size < 2**16 else np.uint32)


def cache_dir_for(root: Path, corpus: Corpus, tokenizer: Tokenizer) -> Path:
    return root / "tokens" / f"{corpus.name}-{FORMAT}-{corpus.digest[:16]}-{tokenizer.digest[:16]}"


def text_batches(documents: Iterable[str]) -> Iterator[list[str]]:
    """Documents grouped into batches of about BATCH_CHARS; blank documents are dropped
    (each would be a lone eos)."""
    batch: list[str] = []
    size = 0
    for doc in documents:
        if not doc.strip():
            continue
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _tmp(path: Path) -> Path:
    return path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")


def write_tokens(
    documents: Iterable[str], tokenizer: Tokenizer, bin_path: Path, offsets_path: Path
) -> None:
    dtype = token_dtype(tokenizer.vocab_size)
    lengths: list[int] = []
    tmp_bin, tmp_offsets = _tmp(bin_path), _tmp(offsets_path)
    try:
        with tmp_bin.open("wb") as f:
            for texts in text_batches(documents):
                docs = [np.array(ids, dtype=dtype) for ids in tokenizer.encode_batch(texts)]
                eos = np.array([tokenizer.eos_id], dtype=dtype)
                np.concatenate([part for d in docs for part in (d, eos)]).tofile(f)
                lengths.extend(len(d) + 1 for d in docs)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        with tmp_offsets.open("wb") as f:
            np.save(f, offsets)
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_offsets, offsets_path)
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_offsets.unlink(missing_ok=True)


def load_tokens(bin_path: Path, offsets_path: Path, tokenizer: Tokenizer) -> TokenDataset | None:
    """The cached split, or None when it is missing or does not match its offsets."""
    if not offsets_path.exists() or not bin_path.exists():
        return None
    offsets = np.load(offsets_path)
    dtype = token_dtype(tokenizer.vocab_size)
    if len(offsets) < 2 or bin_path.stat().st_size != int(offsets[-1]) * dtype.itemsize:
        return None
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    return TokenDataset(tokens, offsets, tokenizer.eos_id)


def tokenized_split(corpus: Corpus, split: str, tokenizer: Tokenizer, root: Path) -> TokenDataset:
    """Load the split's token cache, building it first if no valid one exists."""
    directory = cache_dir_for(root, corpus, tokenizer)
    bin_path, offsets_path = directory / f"{split}.bin", directory / f"{split}.offsets.npy"
    cached = load_tokens(bin_path, offsets_path, tokenizer)
    if cached is not None:
        return cached
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    write_tokens(corpus.documents(split), tokenizer, bin_path, offsets_path)
    data = load_tokens(bin_path, offsets_path, tokenizer)
    if data is None:
        raise DataError(
            f"the {split} split of data={corpus.name} has no text; use a bigger corpus "
            "(or a larger data.val_fraction for val)"
        )
    log.info(
        "tokenised %s/%s: %d documents, %d tokens in %.1fs -> %s",
        corpus.name,
        split,
        data.n_documents,
        data.n_tokens,
        time.perf_counter() - start,
        directory,
    )
    return data
