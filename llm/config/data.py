"""``data.*``: the corpus, the tokenizer and the samples (conf/data/)."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config.require import require_choice, require_positive
from llm.errors import ConfigError


@dataclass
class DataConfig:
    name: str = "stdlib"  # stdlib | wikitext2 | wikitext103 | files
    path: str | None = None  # data=files: a file, folder or glob (.txt/.md/.py, .jsonl, .parquet)
    text_field: str = "text"  # the column holding text in jsonl / parquet / hub datasets
    hub_id: str | None = None  # wikitext: None is Salesforce/wikitext; or a local copy of that repo
    tokenizer: str = "bpe"  # byte | bpe | a local HF tokenizer folder or tokenizer.json
    vocab_size: int = 4096  # bpe only
    tokenizer_train_bytes: int = 8_000_000  # bpe is trained on this much of the train split
    seq_len: int = 256
    packing: bool = True  # False: one document per sample, padded, targets masked
    val_fraction: float = 0.02  # stdlib / files: share of files (one file: documents) held out
    val_samples: int = 256  # validation: the first N samples of the val split, whatever the batch
    cache_dir: str = "${oc.env:LLM_CACHE_DIR,.cache/llm}"  # tokenizers and token caches
    # Training batches a background thread reads (and on CUDA pins) ahead of the step;
    # 0 reads each one when the step asks for it (llm/data/prefetch.py).
    prefetch: int = 2

    def __post_init__(self) -> None:
        require_choice("data", "name", self.name, ("stdlib", "wikitext2", "wikitext103", "files"))
        if self.prefetch < 0:
            raise ConfigError(
                f"data.prefetch={self.prefetch} must be >= 0; 0 reads each batch when the step "
                "asks for it"
            )
        require_positive(
            "data",
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            tokenizer_train_bytes=self.tokenizer_train_bytes,
            val_samples=self.val_samples,
        )
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be in (0, 1)")
        if self.name == "files" and not self.path:
            raise ConfigError("data=files needs data.path=PATH (a file, folder or glob)")
        if self.tokenizer == "bpe" and self.vocab_size < 257:
            raise ConfigError(
                f"data.vocab_size={self.vocab_size} is below the 256 bytes + <|endoftext|> a "
                "byte-level BPE starts from; use >= 257 (or data.tokenizer=byte)"
            )
