"""Architectures only: the GPT-2 and Llama families, a registry of named shapes, meta-device
construction with seeded materialisation, parameter/FLOP counts, and HF import/export.

Parallelism is applied from outside (llm.parallel); nothing here knows about ranks.
"""

from llm.models.args import ModelArgs, RopeScaling
from llm.models.build import build_model, init_weights, materialize
from llm.models.counting import causal_flops_per_token, flops_per_token, num_params
from llm.models.freeze import freeze
from llm.models.hf import from_hf, to_hf
from llm.models.shapes import MODEL_SHAPES, model_args
from llm.models.transformer import Block, Transformer

__all__ = [
    "MODEL_SHAPES",
    "Block",
    "ModelArgs",
    "RopeScaling",
    "Transformer",
    "build_model",
    "causal_flops_per_token",
    "flops_per_token",
    "freeze",
    "from_hf",
    "init_weights",
    "materialize",
    "model_args",
    "num_params",
    "to_hf",
]
