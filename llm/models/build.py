"""Build on the meta device, then materialise with a seeded, device-local init.

Building on meta costs no memory whatever the shape (gpt2-xl, llama3-8b), so parallel/ can
shard or wrap before any storage exists; :func:`materialize` then allocates and initialises.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llm.models.args import ModelArgs
from llm.models.layers import RMSNorm
from llm.models.transformer import Transformer


def build_model(args: ModelArgs, attention_backend: str = "sdpa") -> Transformer:
    """The model for ``args`` with every parameter on the meta device (no storage)."""
    with torch.device("meta"):
        return Transformer(args, attention_backend)


def materialize(model: Transformer, device: str | torch.device, seed: int) -> Transformer:
    """Allocate ``model`` on ``device`` and initialise it; same seed and device -> same bits."""
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each former reference to a tied weight its own copy
    init_weights(model, torch.Generator(device=device).manual_seed(seed))
    return model


@torch.no_grad()
def init_weights(model: Transformer, generator: torch.Generator) -> None:
    """GPT-2 init (Radford et al. 2019): N(0, 0.02) for matrices and embeddings, zeros for
    biases, ones for norm gains; the projections that write into the residual stream (wo, w2)
    get std / sqrt(2 * n_layers), since 2 * n_layers of them add up along the residual path.

    Parameters are visited in module order and the generator is consumed in that order, which
    is what makes the result reproducible.
    """
    args = model.args
    residual_std = args.init_std / math.sqrt(2 * args.n_layers)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            if args.tie_embeddings and module is model.output:
                continue  # shares tok_embeddings.weight, initialised as the embedding
            std = residual_std if name.endswith((".wo", ".w2")) else args.init_std
            module.weight.normal_(0.0, std, generator=generator)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, nn.LayerNorm | RMSNorm):
            module.weight.fill_(1.0)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
