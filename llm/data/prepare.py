"""The entry points the run code calls: prepare the data once, then build loaders per rank.

The launcher calls prepare_data before spawning ranks (training the tokenizer and writing
the token caches); each rank calls it again, through llm.data.per_node, and only loads what
is on disk. Under torchrun or Slurm per_node decides which rank of a node prepares.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm.config import DataConfig
from llm.data.cache import tokenized_split
from llm.data.corpora import build_corpus, cache_root
from llm.data.dataset import TokenDataset
from llm.data.loader import TrainLoader, ValLoader
from llm.data.tokenizer import Tokenizer, build_tokenizer


@dataclass(frozen=True)
class PreparedData:
    tokenizer: Tokenizer
    train: TokenDataset
    val: TokenDataset
    corpus_digest: str  # with tokenizer.digest, identifies the tokens a run trained on


def prepare_data(cfg: DataConfig) -> PreparedData:
    """Build or load the tokenizer and both splits' token caches; cheap when cached."""
    root = cache_root(cfg)
    corpus = build_corpus(cfg)
    tokenizer = build_tokenizer(cfg, corpus)
    return PreparedData(
        tokenizer=tokenizer,
        train=tokenized_split(corpus, "train", tokenizer, root),
        val=tokenized_split(corpus, "val", tokenizer, root),
        corpus_digest=corpus.digest,
    )


def build_train_loader(
    prepared: PreparedData,
    cfg: DataConfig,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
) -> TrainLoader:
    return TrainLoader(
        prepared.train, cfg.seq_len, cfg.packing, micro_batch_size, dp_rank, dp_size, seed
    )


def build_val_loader(
    prepared: PreparedData, cfg: DataConfig, micro_batch_size: int, dp_rank: int, dp_size: int
) -> ValLoader:
    return ValLoader(
        prepared.val,
        cfg.seq_len,
        cfg.packing,
        micro_batch_size,
        dp_rank,
        dp_size,
        cfg.val_samples,
    )
