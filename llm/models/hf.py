"""Import and export of Hugging Face GPT-2, Llama and Mixtral checkpoints (local directories
only); a mixture-of-experts model is exported as Mixtral.

Import reads safetensors slices through :class:`~llm.models.hf_source.HFSource`, which also
holds the name mapping. Export lets transformers write the directory (config.json,
model.safetensors, tied weights); this module only renames and reshapes tensors: GPT-2's
Conv1D projections are (in, out) where ours are nn.Linear (out, in), and its q/k/v are fused
into c_attn; Mixtral's module stacks the experts and fuses each one's w1 and w3 into
gate_up_proj (save_pretrained then writes them one tensor per expert, as the Hub has them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor

from llm.models.args import ModelArgs
from llm.models.build import build_model
from llm.models.hf_config import hf_config
from llm.models.hf_source import (
    GPT2_CONV,
    GPT2_NORMS,
    LLAMA_BLOCK,
    LLAMA_MLP,
    MIXTRAL_GATE_UP,
    MIXTRAL_MOE,
    HFSource,
)
from llm.models.transformer import Transformer
from llm.models.weights import materialize_from

StateDict = dict[str, Tensor]


def _gpt2_to_hf(ours: StateDict, args: ModelArgs) -> StateDict:
    hf = {
        "transformer.wte.weight": ours["tok_embeddings.weight"],
        "transformer.wpe.weight": ours["pos_embeddings.weight"],
        "transformer.ln_f.weight": ours["norm.weight"],
        "transformer.ln_f.bias": ours["norm.bias"],
        "lm_head.weight": ours["output.weight"],
    }
    for i in range(args.n_layers):
        src, dst = f"layers.{i}.", f"transformer.h.{i}."
        for name, hf_name in GPT2_NORMS.items():
            for p in ("weight", "bias"):
                hf[f"{dst}{hf_name}.{p}"] = ours[f"{src}{name}.{p}"]
        for name, hf_name in GPT2_CONV.items():
            hf[f"{dst}{hf_name}.weight"] = ours[f"{src}{name}.weight"].t().contiguous()
            hf[f"{dst}{hf_name}.bias"] = ours[f"{src}{name}.bias"]
        projs = [f"{src}attention.{p}" for p in ("wq", "wk", "wv")]
        hf[f"{dst}attn.c_attn.weight"] = (
            torch.cat([ours[f"{p}.weight"] for p in projs]).t().contiguous()
        )
        hf[f"{dst}attn.c_attn.bias"] = torch.cat([ours[f"{p}.bias"] for p in projs])
    return hf


def _llama_to_hf(ours: StateDict, args: ModelArgs) -> StateDict:
    """Llama's names, and Mixtral's in MoE blocks."""
    inverse = {
        "model.embed_tokens.weight": ours["tok_embeddings.weight"],
        "model.norm.weight": ours["norm.weight"],
        "lm_head.weight": ours["output.weight"],
    }
    for i in range(args.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        moe = args.is_moe_layer(i)
        for name, hf_name in (LLAMA_BLOCK | (MIXTRAL_MOE if moe else LLAMA_MLP)).items():
            inverse[f"{dst}{hf_name}"] = ours[f"{src}{name}"]
        if moe:
            experts = f"{src}feed_forward.experts"
            inverse[f"{dst}{MIXTRAL_GATE_UP}"] = torch.cat(
                [ours[f"{experts}.w1"], ours[f"{experts}.w3"]], dim=1
            )
    return inverse


def from_hf(
    path: str | Path,
    attention_backend: str = "sdpa",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """Our model holding the weights of the local HF GPT-2 / Llama / Mixtral checkpoint at
    ``path``, built on meta and filled one parameter at a time (no second copy of the model)."""
    source = HFSource(path)
    model = build_model(source.args, attention_backend).to(dtype)
    return materialize_from(model, source, torch.device(device))


def _real_vocab(args: ModelArgs, state: StateDict) -> tuple[ModelArgs, StateDict]:
    """The shape and weights with a padded vocabulary (model.vocab_multiple, tensor
    parallel) cut back to the tokenizer's: the padded rows are no tokens."""
    real = args.true_vocab_size
    if real is None:
        return args, state
    tables = ("tok_embeddings.weight", "output.weight")
    state = {k: v[:real] if k in tables else v for k, v in state.items()}
    return dataclasses.replace(args, vocab_size=real, true_vocab_size=None), state


def to_hf(model: Transformer, path: str | Path) -> None:
    """Write ``model`` as a directory that transformers' AutoModelForCausalLM.from_pretrained
    loads (config.json + model.safetensors), in the model's parameter dtype; a MoE shape
    Mixtral cannot express is refused before anything is written."""
    from transformers import AutoModelForCausalLM  # on use: ~2 s to import

    args, ours = _real_vocab(model.args, model.state_dict())
    dtype = next(model.parameters()).dtype
    config = hf_config(args, dtype)
    convert = _gpt2_to_hf if args.family == "gpt2" else _llama_to_hf
    state = {k: v.detach().cpu() for k, v in convert(ours, args).items()}
    with torch.device("meta"):  # an empty shell; the tensors come from our model
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    hf.load_state_dict(state, assign=True)
    hf.tie_weights()
    hf.save_pretrained(path)
