"""What ``python -m llm.generate`` does (llm/generate.py holds its Hydra entry): read the
prompts, load the model from a run or a checkpoint, sample through a KV cache (paged by
default), and write ``generate.json`` beside the log: the new tokens and text per prompt,
tokens/s for prefill and decode, and the KV cache's bytes. Keys: llm.config.GenerateConfig."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from llm.config import GenerateConfig
from llm.errors import ConfigError
from llm.inference.generate import Generation, generate
from llm.inference.load import Loaded, load_for_inference
from llm.inference.paged_attention import resolve_kernel
from llm.inference.sampling import SamplingParams
from llm.precision import REDUCE_DTYPES

log = logging.getLogger(__name__)


def resolve(g: GenerateConfig) -> tuple[torch.device, torch.dtype]:
    if g.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "generate.device=cuda but no CUDA device is visible; use generate.device=cpu"
        )
    cuda = g.device == "cuda" or (g.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    if g.dtype == "auto":
        return device, torch.bfloat16 if cuda else torch.float32
    return device, REDUCE_DTYPES[g.dtype]  # the same names for the same dtypes


def read_prompts(g: GenerateConfig) -> list[str]:
    if (g.prompt is None) == (g.prompts_file is None):
        raise ConfigError(
            "give exactly one of generate.prompt=TEXT and generate.prompts_file=PATH (one "
            "prompt a line)"
        )
    if g.prompt is not None:
        return [g.prompt]
    path = Path(g.prompts_file).expanduser()
    if not path.is_file():
        raise ConfigError(f"generate.prompts_file={path} does not exist; fix the path")
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"generate.prompts_file={path} holds no prompt; write one a line")
    return prompts


def encode(loaded: Loaded, prompts: list[str]) -> list[list[int]]:
    """Token ids per prompt; an empty prompt starts from end-of-text (a document's start)."""
    tok, vocab = loaded.tokenizer, loaded.model.args.vocab_size
    if tok.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary is {vocab}: "
            "they do not belong together; give the tokenizer the model was trained with"
        )
    return [tok.encode(p) or [tok.eos_id] for p in prompts]


def texts(loaded: Loaded, generation: Generation) -> list[str]:
    eos = loaded.tokenizer.eos_id
    return [loaded.tokenizer.decode([t for t in out if t != eos]) for out in generation.tokens]


def run(g: GenerateConfig, output_dir: Path) -> dict:
    device, dtype = resolve(g)
    kernel = resolve_kernel(g.kernel, device) if g.paged else "gather"
    prompts = read_prompts(g)
    loaded = load_for_inference(g.run_dir, g.checkpoint, device, g.tokenizer)
    loaded.model.to(dtype)
    ids = encode(loaded, prompts)
    generation = generate(
        loaded.model,
        ids,
        g.max_new_tokens,
        SamplingParams(g.temperature, g.top_k, g.top_p, g.seed),
        loaded.tokenizer.eos_id if g.stop_at_eos else None,
        paged=g.paged,
        block_size=g.block_size,
        cache_tokens=g.cache_tokens,
        kernel=kernel,
        vocab_size=loaded.tokenizer.vocab_size,
    )
    stats = generation.stats
    result = {
        "source": str(loaded.source),
        "step": loaded.step,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "paged": g.paged,
        "kernel": kernel,
        "block_size": g.block_size if g.paged else None,
        "prompts": prompts,
        "prompt_tokens": ids,
        "tokens": generation.tokens,
        "text": texts(loaded, generation),
        "tokens_per_s": stats.tokens_per_s(),
        "kv_cache_bytes": generation.kv_cache_bytes,
        "preemptions": stats.preemptions,
        "max_running": stats.max_running,
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "generate.json").write_text(json.dumps(result, indent=2))
    return result


def print_result(result: dict, output_dir: Path) -> None:
    """Each prompt with its continuation, then one line of speeds, cache bytes and where
    generate.json is."""
    for prompt, text in zip(result["prompts"], result["text"], strict=True):
        print(f"{prompt}{text}\n---")
    speed = result["tokens_per_s"]
    kv = result["kv_cache_bytes"]
    line = (
        f"{result['source']}: prefill {speed['prefill'] or 0:,.0f} tokens/s, decode "
        f"{speed['decode'] or 0:,.0f} tokens/s; KV cache {kv['allocated'] / 2**20:.2f} MiB "
        f"allocated, {kv['peak_used'] / 2**20:.2f} MiB at most in use "
        f"({kv['per_token']:,} bytes a token); {output_dir / 'generate.json'}"
    )
    log.info(line)  # Hydra's job logging prints it and writes it to the log beside the json
