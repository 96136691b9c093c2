"""Initial weights from a local Hugging Face GPT-2 / Llama / Mixtral checkpoint, read slice
by slice.

safetensors' ``get_slice`` reads only the requested part of a tensor from disk, so a rank
that holds rows [a, b) of a parameter reads those rows and nothing else. Our names map onto
HF's here: Llama keys one to one (HF's rotate_half RoPE is ours); Mixtral is Llama with
mixture-of-experts blocks, whose experts (rows of our w1/w3/w2) are on disk one tensor per
expert, or stacked with w1 and w3 fused into gate_up_proj; GPT-2 stores its projections as
Conv1D, i.e. (in, out), so our rows are its columns, and fuses q/k/v into c_attn, whose
columns are q | k | v.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from llm.errors import ConfigError
from llm.models.args import ModelArgs
from llm.models.hf_config import args_from_hf
from llm.models.transformer import Transformer
from llm.models.weights import WeightSource, param_name

# (ours, HF) per block, for tensors that only change name: attention and norms (Llama's
# and Mixtral's), then the feed-forward of a dense block (Llama).
LLAMA_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
LLAMA_MLP = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
# Mixtral's MoE block as transformers 5 holds it in memory (and writes it with
# save_pretrained(save_original_format=False)): experts stacked along dim 0, each one's w1 and
# w3 concatenated along dim 1 into gate_up_proj (E, 2F, d).
MIXTRAL_MOE = {
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.experts.w2": "mlp.experts.down_proj",
}
MIXTRAL_GATE_UP = "mlp.experts.gate_up_proj"
# ... and as the Hub's Mixtral checkpoints and save_pretrained's default hold it: one tensor
# per expert, {} its index, named as ours.
MIXTRAL_SAVED = {
    "feed_forward.router.gate.weight": "block_sparse_moe.gate.weight",
    **{
        f"feed_forward.experts.{w}": f"block_sparse_moe.experts.{{}}.{w}.weight"
        for w in ("w1", "w3", "w2")
    },
}
GPT2_NORMS = {"attention_norm": "ln_1", "ffn_norm": "ln_2"}
# Conv1D modules: ours (Linear) -> HF; weights transposed, biases as they are.
GPT2_CONV = {
    "attention.wo": "attn.c_proj",
    "feed_forward.w1": "mlp.c_fc",
    "feed_forward.w2": "mlp.c_proj",
}
SAFETENSORS, INDEX = "model.safetensors", "model.safetensors.index.json"


class Spec(NamedTuple):
    """Where one of our parameters lives in the checkpoint: rows [a, b) of ours are
    key[offset + a : offset + b], or its columns when ``transposed`` (Conv1D); with
    ``within`` (lo, hi), only dim-1 indices [lo, hi) of those rows (one half of Mixtral's
    gate_up_proj); with ``per_row``, row r is the whole tensor key.format(r) (Mixtral's
    experts saved one by one)."""

    key: str
    transposed: bool = False
    offset: int = 0
    within: tuple[int, int] | None = None
    per_row: bool = False

    def keys(self, n_rows: int) -> list[str]:
        """The checkpoint keys a parameter of ``n_rows`` rows reads."""
        return [self.key.format(r) for r in range(n_rows)] if self.per_row else [self.key]


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _read_config(path: Path):
    from transformers import AutoConfig  # on use: ~2 s to import

    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{path} is not a Hugging Face checkpoint directory (no config.json); "
            "point model.init_from at a directory written by save_pretrained"
        )
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{path}/config.json cannot be read ({_first_line(err)}); re-save the checkpoint"
        ) from None


def _cannot_load(path: Path, why: str) -> ConfigError:
    return ConfigError(f"weights in {path} cannot be loaded ({why}); re-save the checkpoint")


def _key_files(path: Path) -> dict[str, Path]:
    """Every tensor key in the checkpoint and the safetensors file holding it."""
    from safetensors import SafetensorError, safe_open

    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        return {key: path / file for key, file in weight_map.items()}
    if not (path / SAFETENSORS).is_file():
        raise _cannot_load(path, f"no {SAFETENSORS}; model.init_from reads safetensors only")
    try:
        with safe_open(path / SAFETENSORS, framework="pt") as f:
            return dict.fromkeys(f.keys(), path / SAFETENSORS)
    except SafetensorError as err:
        raise _cannot_load(path, _first_line(err)) from None


def _gpt2_specs(n_layers: int, d_model: int, keys) -> dict[str, Spec]:
    # Hub GPT-2 checkpoints predate the "transformer." prefix that save_pretrained writes.
    pre = "transformer." if "transformer.wte.weight" in keys else ""
    head = "lm_head.weight" if "lm_head.weight" in keys else f"{pre}wte.weight"
    specs = {
        "tok_embeddings.weight": Spec(f"{pre}wte.weight"),
        "pos_embeddings.weight": Spec(f"{pre}wpe.weight"),
        "norm.weight": Spec(f"{pre}ln_f.weight"),
        "norm.bias": Spec(f"{pre}ln_f.bias"),
        "output.weight": Spec(head),
    }
    for i in range(n_layers):
        src, dst = f"{pre}h.{i}.", f"layers.{i}."
        for name, hf_name in GPT2_NORMS.items():
            for p in ("weight", "bias"):
                specs[f"{dst}{name}.{p}"] = Spec(f"{src}{hf_name}.{p}")
        for name, hf_name in GPT2_CONV.items():
            specs[f"{dst}{name}.weight"] = Spec(f"{src}{hf_name}.weight", transposed=True)
            specs[f"{dst}{name}.bias"] = Spec(f"{src}{hf_name}.bias")
        for j, proj in enumerate(("wq", "wk", "wv")):
            qkv = f"{src}attn.c_attn"
            specs[f"{dst}attention.{proj}.weight"] = Spec(f"{qkv}.weight", True, j * d_model)
            specs[f"{dst}attention.{proj}.bias"] = Spec(f"{qkv}.bias", False, j * d_model)
    return specs


def _llama_specs(args: ModelArgs, keys) -> dict[str, Spec]:
    """Llama's names, and Mixtral's in the blocks that ``args`` makes MoE."""
    head = "lm_head.weight" if "lm_head.weight" in keys else "model.embed_tokens.weight"
    specs = {
        "tok_embeddings.weight": Spec("model.embed_tokens.weight"),
        "norm.weight": Spec("model.norm.weight"),
        "output.weight": Spec(head),
    }
    for i in range(args.n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        if not args.is_moe_layer(i):
            block = {name: Spec(hf) for name, hf in (LLAMA_BLOCK | LLAMA_MLP).items()}
        elif f"{src}{MIXTRAL_GATE_UP}" in keys:
            f = args.d_expert
            block = {name: Spec(hf) for name, hf in (LLAMA_BLOCK | MIXTRAL_MOE).items()}
            block["feed_forward.experts.w1"] = Spec(MIXTRAL_GATE_UP, within=(0, f))
            block["feed_forward.experts.w3"] = Spec(MIXTRAL_GATE_UP, within=(f, 2 * f))
        else:
            block = {
                name: Spec(hf, per_row="{}" in hf)
                for name, hf in (LLAMA_BLOCK | MIXTRAL_SAVED).items()
            }
        for name, spec in block.items():
            specs[f"{dst}{name}"] = spec._replace(key=f"{src}{spec.key}")
    return specs


class HFSource(WeightSource):
    """The weights of the checkpoint directory ``path`` (config.json plus model.safetensors
    or an index of shards); ``args`` is its shape. Malformed or incomplete checkpoints are
    refused here, before any rank allocates anything."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.path = path
        self.args = args_from_hf(_read_config(path), path)
        self._files = _key_files(path)
        with torch.device("meta"):
            self._shapes = {n: p.shape for n, p in Transformer(self.args).named_parameters()}
        a = self.args
        specs = (
            _gpt2_specs(a.n_layers, a.d_model, self._files)
            if a.family == "gpt2"
            else _llama_specs(a, self._files)
        )
        self._specs = {name: specs[name] for name in self._shapes}
        needed = {k for n, s in self._specs.items() for k in s.keys(self._shapes[n][0])}
        missing = sorted(needed - self._files.keys())
        if missing:
            raise ConfigError(
                f"{path} lacks weights {missing[:3]} ({len(missing)} in all); "
                "the checkpoint is incomplete, re-save it"
            )

    def shape(self, name: str) -> torch.Size:
        return self._shapes[param_name(name)]

    def rows(self, name: str, start: int, stop: int, device: torch.device) -> Tensor:
        spec = self._specs[param_name(name)]
        lo, hi = spec.offset + start, spec.offset + stop
        if spec.per_row:
            parts = [self._read(spec.key.format(r), slice(None)) for r in range(lo, hi)]
            values = torch.stack(parts) if parts else torch.empty(0, *self.shape(name)[1:])
        elif spec.transposed:
            values = self._read(spec.key, (slice(None), slice(lo, hi))).t()
        elif spec.within is not None:
            values = self._read(spec.key, (slice(lo, hi), slice(*spec.within)))
        else:
            values = self._read(spec.key, slice(lo, hi))
        expected = (stop - start, *self.shape(name)[1:])
        if tuple(values.shape) != expected:
            raise ConfigError(
                f"{self.path}: {spec.key} does not have the shape config.json implies "
                f"(rows {start}:{stop} of {name} should be {expected}); re-save the checkpoint"
            )
        return values.to(device, torch.float32).contiguous()

    def _read(self, key: str, index) -> Tensor:
        """``key``'s tensor indexed by ``index``, reading only that part from disk."""
        from safetensors import safe_open

        with safe_open(self._files[key], framework="pt") as f:
            return f.get_slice(key)[index]
