"""The model's shape from model.*: a registry shape with the config's overrides, and the
tokenizer's vocabulary that fills in an unset model.vocab_size."""

from __future__ import annotations

import dataclasses

from llm.config import Config
from llm.data.tokenizer import ByteTokenizer
from llm.models import ModelArgs, model_args


def tokenizer_vocab_size(cfg: Config) -> int:
    """The vocabulary the run's tokenizer will have, known before it is built: the byte
    tokenizer's 257, else data.vocab_size (the size a BPE is trained to; an HF tokenizer's
    own is known only once loaded)."""
    return ByteTokenizer.vocab_size if cfg.data.tokenizer == "byte" else cfg.data.vocab_size


def model_args_for(cfg: Config, vocab_size: int | None = None) -> ModelArgs:
    """The registry shape named by model.name with the config's overrides applied;
    ``vocab_size`` (the tokenizer's) fills in when model.vocab_size is unset."""
    m = cfg.model
    return model_args(
        m.name,
        vocab_size=m.vocab_size or vocab_size,
        max_seq_len=m.max_seq_len,
        d_model=m.d_model,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        d_ff=m.d_ff,
        dropout=m.dropout,
        moe=dataclasses.asdict(m.moe),
    )
