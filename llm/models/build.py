"""Build on the meta device, then materialise with a seeded, per-parameter init.

Building on meta costs no memory whatever the shape (gpt2-xl, llama3-8b), so parallel/ can
shard or wrap before any storage exists and then fill only what a rank holds from a
:class:`~llm.models.weights.WeightSource`; :func:`materialize` fills a whole model.
"""

from __future__ import annotations

import torch

from llm.models.args import ModelArgs
from llm.models.transformer import Transformer
from llm.models.weights import InitSource, materialize_from


def build_model(
    args: ModelArgs,
    attention_backend: str = "sdpa",
    sdpa_kernel: str = "auto",
    reset_positions: bool = False,
) -> Transformer:
    """The model for ``args`` with every parameter on the meta device (no storage)."""
    with torch.device("meta"):
        return Transformer(args, attention_backend, sdpa_kernel, reset_positions)


def materialize(model: Transformer, device: str | torch.device, seed: int) -> Transformer:
    """Allocate ``model`` on ``device`` with GPT-2 init (:class:`InitSource`); the same seed
    and device type give the same bits, as every strategy's sharded init does."""
    return materialize_from(model, InitSource(model.args, seed), torch.device(device))
