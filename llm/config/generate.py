"""``generate.*``: ``python -m llm.generate``'s options."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config.require import require_choice, require_positive
from llm.errors import ConfigError


@dataclass
class GenerateConfig:
    """``python -m llm.generate`` (docs/inference.md): sample from a trained or imported model.

    The model comes from ``run_dir`` (its newest checkpoint that verifies) or ``checkpoint``
    (a checkpoint folder of ours, or a Hugging Face model folder); prompts from ``prompt`` or
    ``prompts_file`` (one per line, batched together)."""

    run_dir: str | None = None
    checkpoint: str | None = None
    # None: the run's own (saved beside its checkpoints), or the HF folder's; else byte, a
    # tokenizer.json or a tokenizer folder, checked against the one the checkpoint trained on.
    tokenizer: str | None = None
    prompt: str | None = None
    prompts_file: str | None = None
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token
    seed: int = 0
    stop_at_eos: bool = True
    paged: bool = True  # the KV cache in blocks (PagedAttention) or one slab per sequence
    block_size: int = 16  # tokens per KV block
    # The KV cache's budget in tokens over all sequences; None: every prompt's longest
    # possible sequence (prompt + max_new_tokens, at most the model's max_seq_len).
    cache_tokens: int | None = None
    # The paged cache's attention read: gather (blocks gathered, then SDPA: any device),
    # triton (our kernel reading the block table), flex (FlexAttention over the blocks);
    # auto: triton on CUDA, gather elsewhere.
    kernel: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16

    def __post_init__(self) -> None:
        require_positive("generate", max_new_tokens=self.max_new_tokens, block_size=self.block_size)
        require_positive("generate", cache_tokens=self.cache_tokens)
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"generate.temperature={self.temperature}, top_k={self.top_k}, top_p="
                f"{self.top_p}: need temperature >= 0 (0: greedy), top_k >= 0 (0: off) and "
                "0 < top_p <= 1"
            )
        require_choice("generate", "kernel", self.kernel, ("auto", "gather", "triton", "flex"))
        require_choice("generate", "device", self.device, ("auto", "cpu", "cuda"))
        require_choice("generate", "dtype", self.dtype, ("auto", "fp32", "bf16", "fp16"))
