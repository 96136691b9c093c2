"""Import and export of Hugging Face GPT-2 and Llama checkpoints (local directories only).

transformers does the reading and writing (config.json, safetensors or .bin, shards, tied
weights, legacy key names); this module only renames and reshapes tensors. GPT-2 stores its
projections as Conv1D, i.e. (in, out), and fuses q/k/v into c_attn; ours are nn.Linear
(out, in) with separate q/k/v. Llama keys map one to one (HF's rotate_half RoPE is ours).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from llm.errors import ConfigError
from llm.models.build import build_model
from llm.models.hf_config import args_from_hf, hf_config
from llm.models.transformer import Transformer

StateDict = dict[str, Tensor]

# (ours, HF) per block, for tensors that only change name.
_LLAMA_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_GPT2_NORMS = {"attention_norm": "ln_1", "ffn_norm": "ln_2"}
# Conv1D modules: ours (Linear) -> HF; weights transposed, biases as they are.
_GPT2_CONV = {
    "attention.wo": "attn.c_proj",
    "feed_forward.w1": "mlp.c_fc",
    "feed_forward.w2": "mlp.c_proj",
}


def _gpt2_from_hf(hf: StateDict, n_layers: int) -> StateDict:
    ours = {
        "tok_embeddings.weight": hf["transformer.wte.weight"],
        "pos_embeddings.weight": hf["transformer.wpe.weight"],
        "norm.weight": hf["transformer.ln_f.weight"],
        "norm.bias": hf["transformer.ln_f.bias"],
        "output.weight": hf.get("lm_head.weight", hf["transformer.wte.weight"]),
    }
    for i in range(n_layers):
        src, dst = f"transformer.h.{i}.", f"layers.{i}."
        for name, hf_name in _GPT2_NORMS.items():
            for p in ("weight", "bias"):
                ours[f"{dst}{name}.{p}"] = hf[f"{src}{hf_name}.{p}"]
        for name, hf_name in _GPT2_CONV.items():
            ours[f"{dst}{name}.weight"] = hf[f"{src}{hf_name}.weight"].t().contiguous()
            ours[f"{dst}{name}.bias"] = hf[f"{src}{hf_name}.bias"]
        # c_attn.weight is (d, 3d): columns are q | k | v.
        qkv_w = hf[f"{src}attn.c_attn.weight"].t().chunk(3, dim=0)  # 3 x (d, d)
        qkv_b = hf[f"{src}attn.c_attn.bias"].chunk(3, dim=0)  # 3 x (d,)
        for proj, w, b in zip(("wq", "wk", "wv"), qkv_w, qkv_b, strict=True):
            # Own storage per tensor, not views into the fused one.
            ours[f"{dst}attention.{proj}.weight"] = w.clone(memory_format=torch.contiguous_format)
            ours[f"{dst}attention.{proj}.bias"] = b.clone()
    return ours


def _gpt2_to_hf(ours: StateDict, n_layers: int) -> StateDict:
    hf = {
        "transformer.wte.weight": ours["tok_embeddings.weight"],
        "transformer.wpe.weight": ours["pos_embeddings.weight"],
        "transformer.ln_f.weight": ours["norm.weight"],
        "transformer.ln_f.bias": ours["norm.bias"],
        "lm_head.weight": ours["output.weight"],
    }
    for i in range(n_layers):
        src, dst = f"layers.{i}.", f"transformer.h.{i}."
        for name, hf_name in _GPT2_NORMS.items():
            for p in ("weight", "bias"):
                hf[f"{dst}{hf_name}.{p}"] = ours[f"{src}{name}.{p}"]
        for name, hf_name in _GPT2_CONV.items():
            hf[f"{dst}{hf_name}.weight"] = ours[f"{src}{name}.weight"].t().contiguous()
            hf[f"{dst}{hf_name}.bias"] = ours[f"{src}{name}.bias"]
        projs = [f"{src}attention.{p}" for p in ("wq", "wk", "wv")]
        hf[f"{dst}attn.c_attn.weight"] = (
            torch.cat([ours[f"{p}.weight"] for p in projs]).t().contiguous()
        )
        hf[f"{dst}attn.c_attn.bias"] = torch.cat([ours[f"{p}.bias"] for p in projs])
    return hf


def _llama_from_hf(hf: StateDict, n_layers: int) -> StateDict:
    ours = {
        "tok_embeddings.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
        "output.weight": hf.get("lm_head.weight", hf["model.embed_tokens.weight"]),
    }
    for i in range(n_layers):
        for name, hf_name in _LLAMA_BLOCK.items():
            ours[f"layers.{i}.{name}"] = hf[f"model.layers.{i}.{hf_name}"]
    return ours


def _llama_to_hf(ours: StateDict, n_layers: int) -> StateDict:
    inverse = {
        "model.embed_tokens.weight": ours["tok_embeddings.weight"],
        "model.norm.weight": ours["norm.weight"],
        "lm_head.weight": ours["output.weight"],
    }
    for i in range(n_layers):
        for name, hf_name in _LLAMA_BLOCK.items():
            inverse[f"model.layers.{i}.{hf_name}"] = ours[f"layers.{i}.{name}"]
    return inverse


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def from_hf(
    path: str | Path,
    attention_backend: str = "sdpa",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """Our model holding the weights of the local HF GPT-2 / Llama checkpoint at ``path``."""
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM  # on use: ~2 s to import

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{path} is not a Hugging Face checkpoint directory (no config.json); "
            "point model.init_from at a directory written by save_pretrained"
        )
    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{path}/config.json cannot be read ({_first_line(err)}); re-save the checkpoint"
        ) from None
    args = args_from_hf(cfg, path)
    try:
        hf, info = AutoModelForCausalLM.from_pretrained(
            path, config=cfg, dtype=dtype, local_files_only=True, output_loading_info=True
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        raise ConfigError(
            f"weights in {path} cannot be loaded ({_first_line(err)}); re-save the checkpoint"
        ) from None
    # from_pretrained fills missing weights with random init and only warns; we refuse.
    missing = sorted(info["missing_keys"])
    if missing:
        raise ConfigError(
            f"{path} lacks weights {missing[:3]} ({len(missing)} in all); "
            "the checkpoint is incomplete, re-save it"
        )
    convert = _gpt2_from_hf if args.family == "gpt2" else _llama_from_hf
    state = convert(hf.state_dict(), args.n_layers)
    del hf
    model = build_model(args, attention_backend)
    model.load_state_dict(state, assign=True)  # adopt the loaded tensors: no second copy
    model.tie_weights()
    return model.to(device)


def to_hf(model: Transformer, path: str | Path) -> None:
    """Write ``model`` as a directory that transformers' AutoModelForCausalLM.from_pretrained
    loads (config.json + model.safetensors), in the model's parameter dtype."""
    from transformers import AutoModelForCausalLM  # on use: ~2 s to import

    args = model.args
    dtype = next(model.parameters()).dtype
    convert = _gpt2_to_hf if args.family == "gpt2" else _llama_to_hf
    state = {k: v.detach().cpu() for k, v in convert(model.state_dict(), args.n_layers).items()}
    with torch.device("meta"):  # an empty shell; the tensors come from our model
        hf = AutoModelForCausalLM.from_config(hf_config(args, dtype), dtype=dtype)
    hf.load_state_dict(state, assign=True)
    hf.tie_weights()
    hf.save_pretrained(path)
