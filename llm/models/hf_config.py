"""ModelArgs <-> Hugging Face configs (GPT2Config, LlamaConfig, MixtralConfig), refusing what
we cannot run.

Mixtral's ``router_aux_loss_coef`` weighs transformers' pooled balance loss (one over every
layer's rows, top_k at perfect balance), so an import takes ``balance_loss="pooled"`` with the
coefficient as it is, and an export of a pooled model writes it back unchanged. A per-layer
model (the blocks' losses summed, each 1 at perfect balance) is exported with the coefficient
scaled by n_layers / top_k, which gives the two losses the same weight at perfect balance,
and a log line says so.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from llm.errors import ConfigError
from llm.models.args import ModelArgs, MoEArgs, RopeScaling

if TYPE_CHECKING:  # transformers is imported on use: it adds ~2 s to `import llm.models`
    from transformers import GPT2Config, LlamaConfig, MixtralConfig, PretrainedConfig

log = logging.getLogger(__name__)


def _unsupported(path: Any, what: str) -> ConfigError:
    return ConfigError(
        f"{path}/config.json uses {what}, which llm.models cannot run; "
        "load it with transformers directly or convert it first"
    )


def args_from_hf(cfg: PretrainedConfig, path: Any) -> ModelArgs:
    """The ModelArgs of a GPT-2, Llama or Mixtral checkpoint's config; ``path`` only names it
    in errors."""
    if cfg.model_type == "gpt2":
        return _gpt2_args(cfg, path)
    if cfg.model_type == "llama":
        return _llama_args(cfg, path)
    if cfg.model_type == "mixtral":
        return _mixtral_args(cfg, path)
    raise ConfigError(
        f"{path} holds a {cfg.model_type!r} checkpoint; from_hf loads gpt2 and llama ones "
        "(mixtral included)"
    )


def _gpt2_args(cfg: GPT2Config, path: Any) -> ModelArgs:
    if cfg.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _unsupported(path, f"activation_function={cfg.activation_function!r}")
    if not cfg.scale_attn_weights or cfg.scale_attn_by_inverse_layer_idx:
        raise _unsupported(path, "non-standard attention scaling")
    if cfg.add_cross_attention:
        raise _unsupported(path, "cross-attention")
    return ModelArgs(
        family="gpt2",
        vocab_size=cfg.vocab_size,
        max_seq_len=cfg.n_positions,
        d_model=cfg.n_embd,
        n_layers=cfg.n_layer,
        n_heads=cfg.n_head,
        n_kv_heads=cfg.n_head,
        d_ff=cfg.n_inner or 4 * cfg.n_embd,
        norm_eps=cfg.layer_norm_epsilon,
        tie_embeddings=cfg.tie_word_embeddings,
        dropout=cfg.resid_pdrop,
    )


def _llama_args(cfg: LlamaConfig, path: Any) -> ModelArgs:
    if cfg.attention_bias or cfg.mlp_bias:
        raise _unsupported(path, "attention or MLP biases")
    return _llama_family_args(cfg, path)


def _mixtral_args(cfg: MixtralConfig, path: Any) -> ModelArgs:
    # Mixtral's two departures from our model, refused where they take effect: attention
    # within a window shorter than the context, and noise on the router's input in training.
    if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_position_embeddings:
        raise _unsupported(path, f"sliding-window attention (sliding_window={cfg.sliding_window})")
    if cfg.router_jitter_noise:
        raise _unsupported(path, f"router_jitter_noise={cfg.router_jitter_noise}")
    moe = MoEArgs(
        n_experts=cfg.num_local_experts,
        top_k=cfg.num_experts_per_tok,
        d_expert=cfg.intermediate_size,
        router="softmax",
        norm_topk=True,
        aux_loss_coef=cfg.router_aux_loss_coef,
        balance_loss="pooled",
    )
    return _llama_family_args(cfg, path, moe)


def _llama_family_args(
    cfg: LlamaConfig | MixtralConfig, path: Any, moe: MoEArgs | None = None
) -> ModelArgs:
    """What Llama and Mixtral share: attention, RoPE, norms, embeddings, and intermediate_size
    (Llama's MLP width, the width of each of Mixtral's experts)."""
    if cfg.hidden_act != "silu":
        raise _unsupported(path, f"a non-SwiGLU MLP (hidden_act={cfg.hidden_act!r})")
    if cfg.head_dim not in (None, cfg.hidden_size // cfg.num_attention_heads):
        raise _unsupported(path, f"head_dim={cfg.head_dim} != hidden_size / num_attention_heads")
    rope = cfg.rope_parameters
    if rope["rope_type"] not in ("default", "llama3"):
        raise _unsupported(path, f"rope_type={rope['rope_type']!r}")
    scaling = None
    if rope["rope_type"] == "llama3":
        scaling = RopeScaling(
            factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_seq_len=rope["original_max_position_embeddings"],
        )
    return ModelArgs(
        family="llama",
        vocab_size=cfg.vocab_size,
        max_seq_len=cfg.max_position_embeddings,
        d_model=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads,
        d_ff=cfg.intermediate_size,
        norm_eps=cfg.rms_norm_eps,
        rope_theta=rope["rope_theta"],
        rope_scaling=scaling,
        tie_embeddings=cfg.tie_word_embeddings,
        dropout=cfg.attention_dropout,
        moe=moe,
    )


def _mixtral_refusal(moe: MoEArgs) -> str | None:
    """Why Mixtral's block (every block: softmax top-k, renormalised, dropless, routed
    experts only) cannot hold ``moe``, or None when it can."""
    if moe.n_shared_experts:
        return f"n_shared_experts={moe.n_shared_experts}: Mixtral has no shared experts"
    if moe.router != "softmax":
        return f"router={moe.router!r}: Mixtral's router is a softmax"
    if moe.first_dense or moe.every != 1:
        return (
            f"first_dense={moe.first_dense}, every={moe.every}: every Mixtral block is a "
            "mixture of experts"
        )
    if moe.capacity_factor is not None:
        return f"capacity_factor={moe.capacity_factor}: Mixtral drops no tokens"
    if not moe.norm_topk:
        return "norm_topk=False: Mixtral renormalises the top-k weights"
    return None


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> PretrainedConfig:
    """The transformers config of the same architecture: GPT2Config, LlamaConfig, or
    MixtralConfig for a mixture of experts (refused where Mixtral cannot express it)."""
    from transformers import GPT2Config, LlamaConfig, MixtralConfig

    if args.family == "gpt2":
        # GPT-2's special tokens (50256) only exist in the full vocabulary.
        eos = 50256 if args.vocab_size > 50256 else None
        return GPT2Config(
            vocab_size=args.vocab_size,
            n_positions=args.max_seq_len,
            n_embd=args.d_model,
            n_layer=args.n_layers,
            n_head=args.n_heads,
            n_inner=args.d_ff,
            activation_function="gelu_new",
            layer_norm_epsilon=args.norm_eps,
            resid_pdrop=args.dropout,
            embd_pdrop=args.dropout,
            attn_pdrop=args.dropout,
            initializer_range=args.init_std,
            tie_word_embeddings=args.tie_embeddings,
            bos_token_id=eos,
            eos_token_id=eos,
            dtype=dtype,
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        s = args.rope_scaling
        rope |= {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        }
    shared = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.d_model,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=args.tie_embeddings,
        attention_dropout=args.dropout,
        initializer_range=args.init_std,
        dtype=dtype,
    )
    if args.moe is None:
        return LlamaConfig(intermediate_size=args.d_ff, **shared)
    why = _mixtral_refusal(args.moe)
    if why is not None:
        raise ConfigError(
            f"model.moe.{why}; to_hf writes mixture-of-experts models as Mixtral, "
            "so this shape cannot be exported"
        )
    return MixtralConfig(
        intermediate_size=args.d_expert,
        num_local_experts=args.moe.n_experts,
        num_experts_per_tok=args.moe.top_k,
        router_aux_loss_coef=_mixtral_aux_coef(args),
        **shared,
    )


def _mixtral_aux_coef(args: ModelArgs) -> float:
    """Mixtral's router_aux_loss_coef for ``args``' balance loss: the coefficient itself when
    pooled; per-layer, scaled so that both weigh balance alike at perfect balance (the
    per-layer losses sum to n_layers there, the pooled one is top_k)."""
    moe = args.moe
    if moe.balance_loss == "pooled":
        return moe.aux_loss_coef
    coef = moe.aux_loss_coef * args.n_layers / moe.top_k
    log.info(
        "model.moe.balance_loss=per_layer is written as Mixtral's pooled balance loss: "
        "router_aux_loss_coef = aux_loss_coef %g x n_layers %d / top_k %d = %g, the same "
        "weight at perfect balance",
        moe.aux_loss_coef,
        args.n_layers,
        moe.top_k,
        coef,
    )
    return coef
