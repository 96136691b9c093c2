"""The registry of named shapes and :func:`model_args`, the one way config turns into a shape."""

from __future__ import annotations

import dataclasses
from typing import Any

from llm.errors import ConfigError
from llm.models.args import ModelArgs, MoEArgs, RopeScaling


def _gpt2(d_model: int, n_layers: int, n_heads: int, **kw: Any) -> ModelArgs:
    return ModelArgs(
        family="gpt2",
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        d_ff=4 * d_model,
        **kw,
    )


def _llama(**kw: Any) -> ModelArgs:
    return ModelArgs(**{"family": "llama", "norm_eps": 1e-5, "tie_embeddings": False, **kw})


MODEL_SHAPES: dict[str, ModelArgs] = {
    # vocab_size: runs and the estimator take the tokenizer's in its place unless the config
    # sets model.vocab_size, as conf/model/*.yaml does for the published shapes below
    # (not gpt2-small/medium/large or llama-1b, which tests and benchmarks train on a small
    # tokenizer). Test and laptop shapes:
    "gpt2-tiny": _gpt2(64, 2, 4, vocab_size=4096, max_seq_len=256),
    "gpt2-mini": _gpt2(128, 4, 4, vocab_size=4096, max_seq_len=512),
    # OpenAI's GPT-2 family (Radford et al. 2019); "small" is the 124M model.
    "gpt2-small": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    "dialogpt-large": _gpt2(1280, 36, 20),  # microsoft/DialoGPT-large: GPT-2 large weights shape
    # Published large runs, for the estimator (python -m llm.estimate; built on meta only).
    # GPT-3 175B (Brown et al. 2020, table 2.1).
    "gpt3-175b": _gpt2(12288, 96, 96, max_seq_len=2048),
    # BLOOM-176B (BigScience 2022): its ALiBi and embedding LayerNorm are not modelled (a
    # learned position table stands in: 2048 x d, 0.02% of the parameters).
    "bloom-176b": _gpt2(14336, 70, 112, vocab_size=250880, max_seq_len=2048),
    # Megatron-LM's 1T GPT (Narayanan et al. 2021, table 1; vocabulary 51,200).
    "megatron-1t": _gpt2(25600, 128, 160, vocab_size=51200, max_seq_len=2048),
    "llama-tiny": _llama(
        vocab_size=4096, max_seq_len=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192
    ),
    # meta-llama/Llama-3.2-1B, including its llama3 RoPE rescaling and 128K context.
    "llama-1b": _llama(
        vocab_size=128256,
        max_seq_len=131072,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        d_ff=8192,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
        tie_embeddings=True,
    ),
    "llama2-7b": _llama(
        vocab_size=32000,
        max_seq_len=4096,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        d_ff=11008,
    ),
    "llama3-8b": _llama(
        vocab_size=128256,
        max_seq_len=8192,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        rope_theta=500000.0,
    ),
    # Mixture of experts (llm/models/moe.py). moe-tiny trains on a laptop CPU: llama-tiny's
    # attention, 8 experts of half llama-tiny's MLP width, 2 per token, so a token multiplies
    # as many MLP weights as llama-tiny's (the moe experiment's dense twin).
    "moe-tiny": _llama(
        vocab_size=4096,
        max_seq_len=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=192,
        moe=MoEArgs(n_experts=8, top_k=2, d_expert=96),
    ),
    # mistralai/Mixtral-8x7B-v0.1: 46.7B parameters, 12.9B active.
    "mixtral-8x7b": _llama(
        vocab_size=32000,
        max_seq_len=32768,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        rope_theta=1e6,
        # Its config's router_aux_loss_coef, which weighs transformers' pooled loss.
        moe=MoEArgs(n_experts=8, top_k=2, aux_loss_coef=0.02, balance_loss="pooled"),
    ),
    # deepseek-ai/deepseek-moe-16b-base (Dai et al. 2024): 64 routed experts of width 1408,
    # 6 per token, 2 shared, the first block dense; 16.4B parameters, 2.8B active.
    "deepseek-moe-16b": _llama(
        vocab_size=102400,
        max_seq_len=4096,
        d_model=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=16,
        d_ff=10944,
        norm_eps=1e-6,
        moe=MoEArgs(
            n_experts=64,
            top_k=6,
            d_expert=1408,
            n_shared_experts=2,
            first_dense=1,
            norm_topk=False,
            aux_loss_coef=0.001,
        ),
    ),
}


def model_args(name: str, **overrides: Any) -> ModelArgs:
    """The registered shape ``name`` with ``overrides`` applied; None values are ignored.

    Two fields follow the ones they derive from unless overridden themselves, so that
    ``n_heads=8`` or ``d_model=256`` on a GPT-2 shape stays a valid GPT-2: an MHA shape keeps
    n_kv_heads == n_heads, and a shape with d_ff == 4 * d_model keeps that ratio.

    ``moe`` is a dict of MoEArgs fields for a mixture-of-experts shape; on a dense shape any
    key is refused.
    """
    if name not in MODEL_SHAPES:
        raise ConfigError(
            f"model.name={name!r} is unknown; choose one of {', '.join(MODEL_SHAPES)}"
        )
    base = MODEL_SHAPES[name]
    changes = {key: value for key, value in overrides.items() if value is not None}
    if "moe" in changes:
        changes["moe"] = _moe_args(name, base.moe, changes["moe"])
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(ModelArgs)})
    if unknown:
        raise ConfigError(
            f"model overrides {unknown} are not ModelArgs fields; "
            f"use some of {', '.join(f.name for f in dataclasses.fields(ModelArgs))}"
        )
    if "n_heads" in changes and "n_kv_heads" not in changes and base.n_kv_heads == base.n_heads:
        changes["n_kv_heads"] = changes["n_heads"]
    if "d_model" in changes and "d_ff" not in changes and base.d_ff == 4 * base.d_model:
        changes["d_ff"] = 4 * changes["d_model"]
    return dataclasses.replace(base, **changes)


def _moe_args(name: str, base: MoEArgs | None, overrides: dict[str, Any]) -> MoEArgs | None:
    """The shape's MoEArgs with ``overrides`` (None values ignored) applied."""
    changes = {key: value for key, value in overrides.items() if value is not None}
    if base is None:
        if changes:
            raise ConfigError(
                f"model.moe.{sorted(changes)[0]} is set but model {name} is dense; drop the "
                "model.moe keys or use a mixture-of-experts shape (model=moe-tiny)"
            )
        return None
    return dataclasses.replace(base, **changes)
