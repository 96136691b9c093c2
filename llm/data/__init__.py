"""Corpora, tokenizers, token caches and the distributed, resumable loaders.

prepare_data(cfg) -> PreparedData(tokenizer, train, val); then per rank
build_train_loader(...) (endless, resumable) and build_val_loader(...) (re-iterable).

May import llm.config, llm.runfiles (checksums, disk space) and llm.errors.
"""

from llm.data.dataset import IGNORE, Batch, TokenDataset
from llm.data.loader import TrainLoader, ValLoader
from llm.data.prepare import PreparedData, build_train_loader, build_val_loader, prepare_data
from llm.data.tokenizer import (
    TOKENIZER_FILE,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    save_tokenizer,
)

__all__ = [
    "IGNORE",
    "TOKENIZER_FILE",
    "Batch",
    "ByteTokenizer",
    "PreparedData",
    "TokenDataset",
    "Tokenizer",
    "TrainLoader",
    "ValLoader",
    "build_train_loader",
    "build_val_loader",
    "load_tokenizer",
    "prepare_data",
    "save_tokenizer",
]
