"""Token caches: each split tokenised once into a flat memmap plus document offsets.

Layout under data.cache_dir: tokens/<corpus>-<format>-<corpus digest>-<tokenizer digest>/
<split>.bin (raw uint16 or uint32), <split>.offsets.npy (int64, n_documents + 1) and
<split>.sums.json (each file's size and checksum). All three are written to unique
temporary names and moved into place with os.replace, the sums last: they are the mark of a
complete cache, so a reader never takes a partial one. The build runs under a file lock
(<split>.lock beside them): processes preparing the same split at once, on one node or on
nodes sharing the folder, build it once; the others wait for the lock and load what the
first wrote. A cache whose files do not match its sums (a torn copy, a bad disk) is
reported in one line and rebuilt.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
from filelock import FileLock

from llm.data.corpora import Corpus
from llm.data.dataset import TokenDataset
from llm.data.tokenizer import Tokenizer
from llm.errors import DataError
from llm.runfiles.checksum import file_record, mismatch

log = logging.getLogger(__name__)

FORMAT = "v2"  # bump when the layout or the document rules below change
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


class CachePaths(NamedTuple):
    bin: Path
    offsets: Path
    sums: Path

    @classmethod
    def of(cls, directory: Path, split: str) -> CachePaths:
        return cls(
            directory / f"{split}.bin",
            directory / f"{split}.offsets.npy",
            directory / f"{split}.sums.json",
        )


def write_tokens(documents: Iterable[str], tokenizer: Tokenizer, paths: CachePaths) -> None:
    dtype = token_dtype(tokenizer.vocab_size)
    lengths: list[int] = []
    tmp = CachePaths(*(_tmp(p) for p in paths))
    try:
        with tmp.bin.open("wb") as f:
            for texts in text_batches(documents):
                docs = [np.array(ids, dtype=dtype) for ids in tokenizer.encode_batch(texts)]
                eos = np.array([tokenizer.eos_id], dtype=dtype)
                np.concatenate([part for d in docs for part in (d, eos)]).tofile(f)
                lengths.extend(len(d) + 1 for d in docs)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        with tmp.offsets.open("wb") as f:
            np.save(f, offsets)
        sums = {"bin": file_record(tmp.bin), "offsets": file_record(tmp.offsets)}
        tmp.sums.write_text(json.dumps(sums))
        os.replace(tmp.bin, paths.bin)
        os.replace(tmp.offsets, paths.offsets)
        os.replace(tmp.sums, paths.sums)
    finally:
        for p in tmp:
            p.unlink(missing_ok=True)


def corruption(paths: CachePaths) -> str | None:
    """Why the cache at ``paths`` cannot be trusted, or None when its files match its sums."""
    try:
        sums = json.loads(paths.sums.read_text())
        return mismatch(paths.bin, sums["bin"]) or mismatch(paths.offsets, sums["offsets"])
    except (ValueError, KeyError, TypeError) as err:
        return f"{paths.sums.name} is unreadable ({err})"


def load_tokens(paths: CachePaths, tokenizer: Tokenizer) -> TokenDataset | None:
    """The cached split, or None when there is none (or it has no document). A corrupt cache
    is reported in one line and treated as missing, so the caller rebuilds it."""
    if not paths.sums.exists():
        return None
    if problem := corruption(paths):
        log.warning("token cache %s is corrupt (%s); rebuilding it", paths.bin.parent, problem)
        return None
    offsets = np.load(paths.offsets)
    dtype = token_dtype(tokenizer.vocab_size)
    if len(offsets) < 2 or paths.bin.stat().st_size != int(offsets[-1]) * dtype.itemsize:
        return None
    tokens = np.memmap(paths.bin, dtype=dtype, mode="r")
    return TokenDataset(tokens, offsets, tokenizer.eos_id)


def tokenized_split(corpus: Corpus, split: str, tokenizer: Tokenizer, root: Path) -> TokenDataset:
    """Load the split's token cache, building it first if no valid one exists."""
    directory = cache_dir_for(root, corpus, tokenizer)
    paths = CachePaths.of(directory, split)
    cached = load_tokens(paths, tokenizer)
    if cached is not None:
        return cached
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(directory / f"{split}.lock"):
        # Another process may have built it while this one waited for the lock.
        if (cached := load_tokens(paths, tokenizer)) is not None:
            return cached
        start = time.perf_counter()
        write_tokens(corpus.documents(split), tokenizer, paths)
    data = load_tokens(paths, tokenizer)
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
