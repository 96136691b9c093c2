"""The shape of a model: one frozen dataclass that both families read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llm.errors import ConfigError

FAMILIES = ("gpt2", "llama")
ROUTERS = ("softmax", "sigmoid")
EXPERT_KERNELS = ("auto", "grouped", "loop")
BALANCE_LOSSES = ("per_layer", "pooled")


@dataclass(frozen=True)
class MoEArgs:
    """A mixture-of-experts feed-forward (llm/models/moe.py) in place of the dense MLP.

    Blocks ``i >= first_dense`` with ``(i - first_dense) % every == 0`` are MoE, the others
    dense (DeepSeek's first_k_dense_replace and moe_layer_freq). Experts are SwiGLU MLPs of
    width ``d_expert``; ``n_shared_experts`` more run on every token, as one SwiGLU of width
    n_shared_experts * d_expert (DeepSeekMoE).
    """

    n_experts: int
    top_k: int = 2
    d_expert: int = 0  # 0: model.d_ff
    n_shared_experts: int = 0
    every: int = 1
    first_dense: int = 0
    # softmax: top-k of softmax(logits) (Mixtral, DeepSeekMoE); sigmoid: top-k of
    # sigmoid(logits) + a per-expert bias that only picks, moved after each step towards
    # balance (DeepSeek-V3's auxiliary-loss-free balancing, rate bias_update_rate).
    router: str = "softmax"
    norm_topk: bool = True  # the k weights divided by their sum (Mixtral: yes)
    aux_loss_coef: float = 0.01  # Switch / GShard load balance: E * sum_i f_i * P_i
    # per_layer: one balance loss per MoE block, f_i each expert's share of the block's
    # assignments (1 at perfect balance; Switch, DeepSeek-V2/V3), the blocks' losses summed.
    # pooled: transformers' load_balancing_loss_func (Mixtral), one loss over every block's
    # router rows pooled, f_i assignments per row (top_k at perfect balance): about
    # top_k / n_moe_blocks times per_layer's weight for the same aux_loss_coef.
    balance_loss: str = "per_layer"
    z_loss_coef: float = 0.0  # ST-MoE router z-loss: mean logsumexp(logits)^2
    bias_update_rate: float = 1e-3  # sigmoid router only
    # Expert capacity ceil(capacity_factor * tokens * top_k / n_experts) over the global
    # micro-batch; assignments past it are dropped, first come first kept. None: dropless.
    capacity_factor: float | None = None
    # grouped: torch._grouped_mm over all experts at once; loop: one matmul per expert;
    # auto: grouped on CUDA devices of compute capability 9.0 and above in 16-bit, else loop.
    kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.n_experts < 1 or self.top_k < 1:
            raise ConfigError(
                f"model.moe.n_experts={self.n_experts} and top_k={self.top_k} must be >= 1"
            )
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"model.moe.top_k={self.top_k} exceeds model.moe.n_experts={self.n_experts}; "
                "lower top_k or add experts"
            )
        if self.router not in ROUTERS:
            raise ConfigError(
                f"model.moe.router={self.router!r} is unknown; choose one of {', '.join(ROUTERS)}"
            )
        if self.balance_loss not in BALANCE_LOSSES:
            raise ConfigError(
                f"model.moe.balance_loss={self.balance_loss!r} is unknown; choose one of "
                f"{', '.join(BALANCE_LOSSES)}"
            )
        if self.kernel not in EXPERT_KERNELS:
            raise ConfigError(
                f"model.moe.kernel={self.kernel!r} is unknown; choose one of "
                f"{', '.join(EXPERT_KERNELS)}"
            )
        if self.every < 1 or self.first_dense < 0 or self.d_expert < 0 or self.n_shared_experts < 0:
            raise ConfigError(
                "model.moe.every must be >= 1 and first_dense, d_expert, n_shared_experts >= 0"
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(
                f"model.moe.capacity_factor={self.capacity_factor} must be > 0, or null for "
                "dropless routing"
            )
        if min(self.aux_loss_coef, self.z_loss_coef, self.bias_update_rate) < 0:
            raise ConfigError(
                "model.moe.aux_loss_coef, z_loss_coef and bias_update_rate must be >= 0"
            )

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_dense and (index - self.first_dense) % self.every == 0


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
    vocab_size: int = 50257  # rows of the embedding and head, padding included
    # Set when vocab_size is padded past the tokenizer's (model.vocab_multiple, tensor
    # parallel): the ids below it are real; the logits of the others are -inf (Transformer).
    true_vocab_size: int | None = None
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
    moe: MoEArgs | None = None  # None: every block has the dense MLP

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(
                f"model family {self.family!r} is unknown; choose one of {', '.join(FAMILIES)}"
            )
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be > 0")
        if self.true_vocab_size is not None and not 0 < self.true_vocab_size < self.vocab_size:
            raise ConfigError(
                f"true_vocab_size={self.true_vocab_size} must be in (0, vocab_size="
                f"{self.vocab_size}); leave it unset for an unpadded vocabulary"
            )
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

        if self.moe is not None and self.family != "llama":
            raise ConfigError(
                "model.moe: experts are SwiGLU MLPs of the llama family; use a llama shape "
                "(model=moe-tiny) or drop model.moe"
            )

    @property
    def real_vocab_size(self) -> int:
        """The ids that are tokens: the tokenizer's vocabulary, padding left out."""
        return self.true_vocab_size or self.vocab_size

    def padded(self, multiple: int) -> ModelArgs:
        """This shape with its embedding and head rounded up to a multiple of ``multiple``
        (Megatron's make-vocab-size-divisible-by), the real vocabulary kept."""
        rows = -(-self.real_vocab_size // multiple) * multiple
        if rows == self.real_vocab_size:
            return dataclasses.replace(self, vocab_size=rows, true_vocab_size=None)
        return dataclasses.replace(self, vocab_size=rows, true_vocab_size=self.real_vocab_size)

    @property
    def d_expert(self) -> int:
        """An expert's hidden width (MoE shapes only)."""
        return self.moe.d_expert or self.d_ff

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(index)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads
