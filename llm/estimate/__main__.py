"""``python -m llm.estimate [overrides]``: the memory a run would need, per rank, without
building it (the model on the meta device), with the same Hydra overrides as train.py plus
``estimate.*`` (llm.config.EstimateConfig); ``estimate.plan=true`` ranks the parallel
layouts that fit the cluster (llm.estimate.plan); ``estimate.mode=inference`` sizes one
tensor-parallel rank's weights and KV cache for ``estimate.batch`` sequences of
``estimate.context`` tokens instead (llm.estimate.inference)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from llm.build import model_args_for, tokenizer_vocab_size
from llm.config import register_configs, to_dataclass
from llm.errors import LabError
from llm.estimate.deepspeed_own import deepspeed_own, largest_layer
from llm.estimate.device_profile import resolve
from llm.estimate.estimator import estimate, meta_model, world_size
from llm.estimate.inference import estimate_inference
from llm.estimate.plan import global_batch, plan, plan_row
from llm.estimate.report import count, human, inference_table, print_estimate
from llm.models import MODEL_SHAPES, num_params
from llm.parallel.tensor_parallel import padded_vocab
from llm.validate import check_vocab

register_configs()
CONF = str(Path(__file__).resolve().parents[2] / "conf")


def model_summary(cfg, args) -> dict:
    """What the estimate sized: the vocabulary and where it came from (model.vocab_size, set
    by a published shape's config or an override, else the tokenizer's), the vocabulary
    tensor parallel pads it to, and the parameter count (estimate.num_params when given)."""
    padded = padded_vocab(args.vocab_size, cfg.parallelism.tp_size, cfg.model.vocab_multiple)
    n = num_params(dataclasses.replace(args, vocab_size=padded))
    if cfg.model.vocab_size is not None:
        source = "model.vocab_size"
    else:
        source = f"data.tokenizer={Path(cfg.data.tokenizer).name}"
    return {
        "name": cfg.model.name,
        "vocab_size": args.vocab_size,
        "vocab_source": source,
        "padded_vocab_size": padded,
        "n_params": n if cfg.estimate.num_params is None else int(cfg.estimate.num_params),
        "n_params_source": "model" if cfg.estimate.num_params is None else "estimate.num_params",
    }


def _sized(model: dict) -> str:
    """E.g. 176.28B parameters, vocabulary 250,880 (model.vocab_size)."""
    if model["n_params_source"] != "model":
        return f"{count(model['n_params'])} parameters (estimate.num_params)"
    vocab = f"vocabulary {model['vocab_size']:,} ({model['vocab_source']})"
    if model["padded_vocab_size"] != model["vocab_size"]:
        vocab += f" padded to {model['padded_vocab_size']:,}"
    return f"{count(model['n_params'])} parameters, {vocab}"


def _title(cfg, model: dict) -> str:
    return (
        f"{cfg.model.name}: {_sized(model)}; {cfg.parallelism.name} x{world_size(cfg)} "
        f"{cfg.precision.name} recompute={cfg.recompute.name} micro_batch={cfg.train.micro_batch_size} "
        f"seq_len={cfg.data.seq_len} attention={cfg.attention.backend} ({cfg.estimate.device})"
    )


def _inference_title(cfg, model: dict, est) -> str:
    return (
        f"{cfg.model.name}: {_sized(model)}; inference tp={est.tp} batch={est.batch} "
        f"context={est.context} {est.dtype} ({cfg.estimate.device})"
    )


def _vocab_note(cfg, args) -> str | None:
    """A line where the tokenizer's vocabulary stands in for a registered shape's own."""
    own = MODEL_SHAPES[cfg.model.name].vocab_size
    if cfg.model.vocab_size is not None or cfg.estimate.num_params is not None:
        return None
    if args.vocab_size == own:
        return None
    return (
        f"note: the vocabulary is the tokenizer's {args.vocab_size:,}, not {cfg.model.name}'s "
        f"registered {own:,}; add model.vocab_size={own} to size that one"
    )


def _deepspeed_lines(cfg, args, est) -> tuple[list[str], dict | None]:
    """parallelism=deepspeed: DeepSpeed's own estimator's per-GPU model states beside ours."""
    par, e = cfg.parallelism, cfg.estimate
    if par.name != "deepspeed":
        return [], None
    if par.zero_stage not in (2, 3):
        return [
            f"DeepSpeed has no estimator of its own for ZeRO stage {par.zero_stage}; ours above "
            "is the ZeRO paper's arithmetic (section 3.1)"
        ], None
    if e.num_params is None:
        model = meta_model(cfg, args.padded(cfg.model.vocab_multiple * par.tp_size))
        n, largest = sum(p.numel() for p in model.parameters()), largest_layer(model)
    else:
        n, largest = int(e.num_params), 0
    gpus = e.gpus_per_node or cfg.launcher.nproc_per_node
    own = deepspeed_own(
        par.zero_stage,
        n,
        largest,
        gpus,
        e.nodes,
        par.offload_optimizer != "none",  # DeepSpeed's estimators: off the GPU, cpu or nvme
        par.offload_params != "none",
    )
    ours = sum(est.device.get(k, 0) for k in ("params", "grads", "optimizer_states"))
    where = own.source if own.source != "transcribed" else "deepspeed not importable: 0.19.8's"
    formula = own.formula + (f", L = {largest:,} (largest layer)" if par.zero_stage == 3 else "")
    lines = [
        f"model states per GPU, ours: {human(ours)}, the ZeRO paper's {own.ours_formula}",
        f"DeepSpeed's own estimate_zero{par.zero_stage}_model_states_mem_needs ({where}): "
        f"{human(own.bytes_per_gpu)}, {formula}; ours is {ours / own.bytes_per_gpu:.2f}x theirs",
    ]
    if e.num_params is not None and par.zero_stage == 3:
        lines.append("(with estimate.num_params the largest layer L is unknown: taken as 0)")
    out = {**own.to_json(), "ours_bytes_per_gpu": ours}
    return lines, out


def _plan_table(cfg, rows, model: dict) -> Table:
    e = cfg.estimate
    table = Table(
        title=f"layouts that fit {e.nodes} x {e.gpus_per_node or cfg.launcher.nproc_per_node} "
        f"GPUs of {e.device_memory_gb:g} GiB, fastest first (global batch "
        f"{global_batch(cfg, world_size(cfg))} x {cfg.data.seq_len} tokens; "
        f"{cfg.model.name}: {_sized(model)})"
    )
    # b: sequences per micro-batch; m: micro-batches per step.
    # ep: expert-parallel ranks (MoE shapes; 1 for a dense model).
    # offload: where the ZeRO states go for the layout to fit (nvme: only files have room).
    names = ("dp", "tp", "pp", "ep", "zero", "offload", "recompute", "b", "m", "per GPU")
    names += ("bubble", "step s")
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        lay = r.layout
        table.add_row(
            *map(str, (lay.dp, lay.tp, lay.pp, lay.ep, lay.zero_stage, r.offload, lay.recompute)),
            str(lay.micro_batch),
            str(lay.microbatches),
            human(r.bytes_per_gpu),
            f"{r.bubble:.1%}",
            f"{r.step_time_s:.2f}",
        )
    return table


def _inference(cfg, args, model: dict, note: str | None) -> None:
    """estimate.mode=inference: one tp rank's weights and KV cache (llm.estimate.inference)."""
    est = estimate_inference(cfg, args)
    Console().print(inference_table(est, _inference_title(cfg, model, est)))
    if note:
        print(note)
    if cfg.estimate.json:
        Path(cfg.estimate.json).write_text(json.dumps({"model": model, **est.to_json()}, indent=2))


@hydra.main(version_base="1.3", config_path=CONF, config_name="config")
def main(dict_cfg: DictConfig) -> None:
    try:
        cfg = to_dataclass(dict_cfg)
        profile = resolve(cfg.estimate.device)  # an unknown device is refused here
        args = model_args_for(cfg, vocab_size=tokenizer_vocab_size(cfg))
        check_vocab(cfg, args)
        model = model_summary(cfg, args)
        note = _vocab_note(cfg, args)
        if cfg.estimate.mode == "inference":
            _inference(cfg, args, model, note)
            return
        est = estimate(cfg, args)
        print_estimate(est, _title(cfg, model))
        out = {"model": model, **est.to_json()}
        lines, own = _deepspeed_lines(cfg, args, est)
        if own is not None:
            out["deepspeed_own"] = own
        for line in ([note] if note else []) + lines:
            print(line)
        if cfg.estimate.plan:
            rows = plan(cfg, args)
            fitting = [r for r in rows if r.fits][: cfg.estimate.plan_rows]
            Console().print(_plan_table(cfg, fitting, model))
            out["plan"] = [plan_row(r) for r in rows]
            if profile is not None:  # where the plan's compute times come from
                print(profile.note)
                out["device_profile"] = profile.note
        if cfg.estimate.json:
            Path(cfg.estimate.json).write_text(json.dumps(out, indent=2))
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


if __name__ == "__main__":
    main()
