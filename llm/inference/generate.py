"""Generate from token prompts: size a KV cache for them, run them through the engine
together, and report what it cost (tokens/s for prefill and decode, cache bytes)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llm.errors import ConfigError
from llm.inference.engine import Engine, EngineStats, Request
from llm.inference.kv_cache import ContiguousKVCache, PagedKVCache, kv_bytes_per_token
from llm.inference.sampling import Sampler, SamplingParams
from llm.models import Transformer


@dataclass
class Generation:
    tokens: list[list[int]]  # the new tokens of each prompt, in prompt order
    stats: EngineStats
    kv_cache_bytes: dict[str, int]  # allocated, per_token, peak_used


def check_prompts(prompts: list[list[int]], max_seq_len: int) -> None:
    for i, prompt in enumerate(prompts):
        if len(prompt) >= max_seq_len:
            raise ConfigError(
                f"prompt {i} has {len(prompt)} tokens but the model's max_seq_len is "
                f"{max_seq_len}, which leaves no room for a new token; shorten the prompt"
            )


def build_cache(
    model: Transformer,
    longest: list[int],
    paged: bool,
    block_size: int,
    cache_tokens: int | None,
    kernel: str,
):
    """A cache for sequences that grow to ``longest`` tokens each: all of them at once, or
    ``cache_tokens`` tokens in all (paged: that many rounded up to blocks; contiguous: rows
    of the longest sequence's length)."""
    param = next(model.parameters())
    args, dtype, device = model.args, param.dtype, param.device
    if paged:
        need = sum(math.ceil(n / block_size) for n in longest)
        blocks = need if cache_tokens is None else math.ceil(cache_tokens / block_size)
        return PagedKVCache(args, blocks, block_size, dtype, device, kernel)
    row_len = max(longest)
    rows = len(longest) if cache_tokens is None else cache_tokens // row_len
    if rows < 1:
        raise ConfigError(
            f"generate.cache_tokens={cache_tokens} is less than one sequence of {row_len} "
            "tokens (a contiguous cache reserves each sequence's longest); raise it"
        )
    return ContiguousKVCache(args, rows, row_len, dtype, device)


def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_id: int | None,
    paged: bool = True,
    block_size: int = 16,
    cache_tokens: int | None = None,
    kernel: str = "gather",
    vocab_size: int | None = None,
) -> Generation:
    """New tokens for each prompt (non-empty id lists), at most ``max_new_tokens`` and never
    past the model's max_seq_len; ``eos_id`` ends a sequence (None: run to the limit);
    ``vocab_size``: the tokenizer's, when the model's is padded past it."""
    limit = model.args.max_seq_len
    check_prompts(prompts, limit)
    budgets = [min(max_new_tokens, limit - len(p)) for p in prompts]
    cache = build_cache(
        model,
        [len(p) + n for p, n in zip(prompts, budgets, strict=True)],
        paged,
        block_size,
        cache_tokens,
        kernel,
    )
    device = next(model.parameters()).device
    engine = Engine(model, cache, Sampler(sampling, device, vocab_size))
    for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        engine.submit(Request(i, list(prompt), budget, eos_id=eos_id))
    done = sorted(engine.run(), key=lambda r: r.id)
    peak = max((used for used, _ in engine.stats.occupancy), default=0)
    per_token = kv_bytes_per_token(model.args, next(model.parameters()).dtype)
    return Generation(
        [r.out for r in done],
        engine.stats,
        {"allocated": cache.nbytes(), "per_token": per_token, "peak_used": peak * per_token},
    )


def full_forward_logits(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """Logits (T, V) of the whole sequence without a cache: what the cached ones must equal."""
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor([tokens], device=device))[0]
