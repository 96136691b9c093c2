"""The shape of a model: one frozen dataclass that both families read."""

from __future__ import annotations

from dataclasses import dataclass

from llm.errors import ConfigError

FAMILIES = ("gpt2", "llama")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's frequency-dependent RoPE rescaling ("llama3" rope_type in HF configs).

    Long wavelengths are divided by ``factor``, short ones kept, the band between blended;
    Llama-3.2-1B ships with factor 32, low 1, high 4, original context 8192.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int


@dataclass(frozen=True)
class ModelArgs:
    family: str = "gpt2"  # gpt2 | llama
    vocab_size: int = 50257
    max_seq_len: int = (
        1024  # GPT-2: rows of the position table; Llama: the longest sequence allowed
    )
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int = 12  # < n_heads: grouped-query attention (Llama only); 1: multi-query
    d_ff: int = 3072  # hidden width of the MLP (per branch for SwiGLU)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # Llama only
    rope_scaling: RopeScaling | None = None  # Llama only
    tie_embeddings: bool = True  # output.weight is tok_embeddings.weight
    # One knob for all three dropout sites (embeddings, attention probabilities, residual
    # branches), as GPT-2's embd/attn/resid_pdrop set to one value.
    dropout: float = 0.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(
                f"model family {self.family!r} is unknown; choose one of {', '.join(FAMILIES)}"
            )
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be > 0")
        if self.d_ff <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ConfigError("model.d_ff, norm_eps and init_std must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "pick n_heads that divides d_model"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads="
                f"{self.n_kv_heads}; pick n_kv_heads that divides n_heads"
            )
        if self.family == "gpt2" and self.n_kv_heads != self.n_heads:
            raise ConfigError(
                f"model.n_kv_heads={self.n_kv_heads} but gpt2 has no grouped-query attention; "
                "drop model.n_kv_heads or use a llama shape"
            )
        if self.family == "llama" and self.head_dim % 2:
            raise ConfigError(
                f"head_dim={self.head_dim} is odd but RoPE rotates pairs; "
                "choose d_model / n_heads even"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads
