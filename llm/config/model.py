"""``model.*``: a registry shape and the overrides of it (conf/model/)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm.config.require import require_positive
from llm.errors import ConfigError


@dataclass
class MoEConfig:
    """Overrides of a mixture-of-experts shape's MoEArgs (llm/models/args.py says what each
    field does); null keeps the shape's value. Any key set on a dense shape is refused."""

    n_experts: int | None = None
    top_k: int | None = None
    d_expert: int | None = None
    n_shared_experts: int | None = None
    every: int | None = None
    first_dense: int | None = None
    router: str | None = None  # softmax | sigmoid
    norm_topk: bool | None = None
    aux_loss_coef: float | None = None
    balance_loss: str | None = None  # per_layer | pooled (transformers' Mixtral loss)
    z_loss_coef: float | None = None
    bias_update_rate: float | None = None
    # Every shape here is dropless (no capacity); a number sets one.
    capacity_factor: float | None = None
    kernel: str | None = None  # auto | grouped | loop


@dataclass
class ModelConfig:
    """A model from the registry (llm.models.MODEL_SHAPES); the fields below override its shape."""

    name: str = "gpt2-tiny"
    init_from: str | None = None  # a local Hugging Face checkpoint directory to load weights from
    # None: the tokenizer's vocabulary size; a published shape's conf/model/*.yaml sets its own.
    vocab_size: int | None = None
    max_seq_len: int | None = None
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    d_ff: int | None = None
    dropout: float = 0.0
    # Rows of the embedding and head rounded up to a multiple of this (x tp_size under tensor
    # parallel), e.g. 128 for tensor-core tiles; the padded ids are never tokens (logits -inf).
    vocab_multiple: int = 1
    # Globs over parameter names (fnmatch), e.g. ["tok_embeddings.*", "layers.0.*"]: frozen
    # parameters get no gradient, no optimizer state and no update under every strategy.
    freeze: list[str] = field(default_factory=list)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        require_positive(
            "model",
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            d_ff=self.d_ff,
            vocab_multiple=self.vocab_multiple,
        )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
