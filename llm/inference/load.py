"""A trained or imported model in one process, for sampling and quantisation.

Sources: a run directory (its newest checkpoint whose files verify), one checkpoint folder
(``step_N`` with meta.json), or a Hugging Face model folder (config.json + safetensors). Our
checkpoints are read through torch DCP, which reassembles whatever layout wrote them (ZeRO's
flat shards, FSDP's and tensor parallel's DTensors, pipeline stages, expert slices) into
whole tensors here. meta.json records the model's shape and the tokenizer's digest; a
checkpoint written before it did falls back to the run's .hydra/config.yaml for the shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from llm.data import TOKENIZER_FILE, ByteTokenizer, Tokenizer, load_tokenizer
from llm.errors import CheckpointError, ConfigError
from llm.logging import say
from llm.models import HFSource, ModelArgs, Transformer, build_model, materialize_from
from llm.models.args import MoEArgs, RopeScaling
from llm.train.checkpoint import SAVE_OR_LOAD_ERRORS, describe, single_process_quiet
from llm.train.checkpoint_files import (
    META,
    file_problem,
    list_checkpoints,
    read_meta,
    skipped_line,
    step_of,
)


@dataclass
class Loaded:
    model: Transformer
    tokenizer: Tokenizer
    source: Path  # the checkpoint or HF folder read
    step: int | None  # the checkpoint's step (None: an HF folder)


def newest_verified(run_dir: Path) -> Path:
    """The newest checkpoint of ``run_dir`` whose files match meta.json (size and checksum);
    each newer one it passes over is named with its problem, as training's resume does."""
    folder = run_dir / "checkpoints"
    found = list_checkpoints(folder)
    if not found:
        raise CheckpointError(
            f"{run_dir} holds no checkpoint (no {folder}/step_N with meta.json); train with "
            "checkpoint.enabled=true, or give generate.checkpoint"
        )
    for candidate in reversed(found):
        if (problem := checkpoint_problem(candidate)) is None:
            return candidate
        say(skipped_line(candidate, problem), logging.WARNING)
    raise CheckpointError(
        f"no checkpoint in {folder} verifies (the newest, {found[-1].name}: "
        f"{checkpoint_problem(found[-1])}); give a good one with generate.checkpoint"
    )


def checkpoint_problem(path: Path) -> str | None:
    meta, why = read_meta(path)
    if meta is None:
        return why
    return next(
        (p for n, r in sorted(meta["files"].items()) if (p := file_problem(path, n, r))), None
    )


def _args_from_meta(meta: dict) -> ModelArgs:
    fields = dict(meta["model_args"])
    if fields.get("moe") is not None:
        fields["moe"] = MoEArgs(**fields["moe"])
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    return ModelArgs(**fields)


def _args_from_run_config(path: Path, tokenizer: Tokenizer) -> ModelArgs:
    """The shape of a checkpoint whose meta.json predates ``model_args``: the run's config."""
    from llm.build import model_args_for
    from llm.config import to_dataclass

    config = path.parent.parent / ".hydra" / "config.yaml"
    if not config.is_file():
        raise CheckpointError(
            f"{path}/{META} records no model shape and {config} is missing; load it with the "
            "code that wrote it, or train again"
        )
    cfg = to_dataclass(OmegaConf.load(config))
    rows = cfg.model.vocab_multiple * cfg.parallelism.tp_size
    return model_args_for(cfg, tokenizer.vocab_size).padded(rows)


def _tokenizer_for(path: Path, meta: dict, spec: str | None) -> Tokenizer:
    """The tokenizer the checkpoint trained with (saved in its run directory), or ``spec``
    when it matches that one's digest."""
    recorded = meta.get("tokenizer_digest")
    saved = path.parent.parent / TOKENIZER_FILE
    if spec is not None:
        tokenizer = load_tokenizer(spec)
        if recorded is not None and tokenizer.digest != recorded:
            raise ConfigError(
                f"generate.tokenizer={spec} is not the tokenizer {path} was trained with "
                "(their digests differ); drop generate.tokenizer to use the run's own"
            )
        return tokenizer
    if recorded == ByteTokenizer.digest:
        return ByteTokenizer()
    if saved.is_file():
        return load_tokenizer(str(saved))
    raise ConfigError(
        f"{saved} is missing, so the tokenizer {path} was trained with is unknown; give it "
        "with generate.tokenizer=PATH (a tokenizer.json, a tokenizer folder, or byte)"
    )


def _read_checkpoint(model: Transformer, path: Path) -> None:
    state = {"model": model.state_dict()}
    with single_process_quiet():
        try:
            dcp.load(state, checkpoint_id=str(path))
        except SAVE_OR_LOAD_ERRORS as exc:  # DCP raises many kinds; all mean unusable
            raise CheckpointError(
                f"checkpoint {path} cannot be read ({describe(exc)}); give another"
            ) from exc
    model.load_state_dict(state["model"])


def load_checkpoint(path: Path, device: torch.device, tokenizer_spec: str | None = None) -> Loaded:
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is unusable: {problem}; give another")
    meta, _ = read_meta(path)
    tokenizer = _tokenizer_for(path, meta, tokenizer_spec)
    args = _args_from_meta(meta) if "model_args" in meta else _args_from_run_config(path, tokenizer)
    model = build_model(args).to_empty(device=device)
    model.tie_weights()
    for module in model.modules():  # buffers (the MoE router's bias) are in the checkpoint
        for name, buffer in module.named_buffers(recurse=False):
            module.register_buffer(name, torch.zeros_like(buffer))
    _read_checkpoint(model, path)
    return Loaded(model.eval(), tokenizer, path, step_of(path))


def load_hf(path: Path, device: torch.device, tokenizer_spec: str | None = None) -> Loaded:
    weights = HFSource(path)
    model = materialize_from(build_model(weights.args), weights, device)
    spec = tokenizer_spec or str(path)
    if tokenizer_spec is None and not any(
        (path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")
    ):
        raise ConfigError(
            f"{path} has no tokenizer (tokenizer.json); give one with generate.tokenizer=PATH"
        )
    return Loaded(model.eval(), load_tokenizer(spec), path, None)


def load_for_inference(
    run_dir: str | None, checkpoint: str | None, device: torch.device, tokenizer: str | None = None
) -> Loaded:
    """The model and tokenizer named by ``run_dir`` or ``checkpoint`` (exactly one)."""
    if (run_dir is None) == (checkpoint is None):
        raise ConfigError(
            "give exactly one of generate.run_dir (a training run's folder) and "
            "generate.checkpoint (a step_N folder or a Hugging Face model folder)"
        )
    path = Path(run_dir or checkpoint).expanduser()
    if not path.exists():
        key = "run_dir" if run_dir else "checkpoint"
        raise ConfigError(f"generate.{key}={path} does not exist; fix the path")
    if run_dir is not None:
        return load_checkpoint(newest_verified(path), device, tokenizer)
    if (path / "config.json").is_file():
        return load_hf(path, device, tokenizer)
    if (path / META).is_file() or step_of(path) >= 0:
        return load_checkpoint(path, device, tokenizer)
    raise ConfigError(
        f"generate.checkpoint={path} is neither a checkpoint (step_N with meta.json) nor a "
        "Hugging Face model folder (config.json); use generate.run_dir for a run's folder"
    )
