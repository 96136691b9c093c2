"""Architectures only: the GPT-2 and Llama families, a registry of named shapes, meta-device
construction, initial-weight sources (seeded init, HF safetensors) read per parameter or
per row, parameter/FLOP counts, and HF import/export.

Parallelism is applied from outside (llm.parallel); nothing here knows about ranks.

May import llm.attention and llm.errors only (never llm.config: llm.build maps the config
to ModelArgs).
"""

from llm.models.args import ModelArgs, RopeScaling
from llm.models.build import build_model, materialize
from llm.models.counting import (
    blocks_params,
    causal_flops_per_token,
    flops_per_token,
    num_active_params,
    num_params,
)
from llm.models.freeze import freeze
from llm.models.hf import from_hf, to_hf
from llm.models.hf_source import HFSource
from llm.models.shapes import MODEL_SHAPES, model_args
from llm.models.transformer import Block, Transformer, mask_padded_vocab, model_blocks
from llm.models.weights import (
    InitSource,
    LocalSource,
    ModuleSource,
    WeightSource,
    adopt,
    flat_range,
    local_region,
    materialize_from,
    param_name,
)

__all__ = [
    "MODEL_SHAPES",
    "Block",
    "HFSource",
    "InitSource",
    "LocalSource",
    "ModelArgs",
    "ModuleSource",
    "RopeScaling",
    "Transformer",
    "WeightSource",
    "adopt",
    "blocks_params",
    "build_model",
    "causal_flops_per_token",
    "flat_range",
    "flops_per_token",
    "freeze",
    "from_hf",
    "local_region",
    "mask_padded_vocab",
    "materialize",
    "materialize_from",
    "model_args",
    "model_blocks",
    "num_active_params",
    "num_params",
    "param_name",
    "to_hf",
]
