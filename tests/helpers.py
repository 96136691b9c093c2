"""Compose configs exactly as train.py does, and run them in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from llm.build import model_args_for
from llm.config import Config, register_configs, to_dataclass
from llm.estimate.estimator import estimate
from llm.launch.launcher import launch
from llm.validate import validate

CONF = Path(__file__).resolve().parent.parent / "conf"


def compose_config(overrides: list[str]) -> Config:
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return to_dataclass(cfg)


def small_run_overrides(output_dir: Path, corpus: Path, cache: Path, *extra: str) -> list[str]:
    """A fast CPU run on the test corpus: tiny model, byte tokenizer, no W&B."""
    return [
        f"output_dir={output_dir}",
        "model=gpt2-tiny",
        "data=files",
        f"data.path={corpus}",
        f"data.cache_dir={cache}",
        "data.tokenizer=byte",
        "data.seq_len=64",
        "data.val_samples=8",
        "train.device=cpu",
        "train.max_steps=6",
        "train.micro_batch_size=4",
        "train.log_every=1",
        "train.eval_every=1000",
        "scheduler.warmup_steps=1",
        "logger=none",
        "logger.progress=false",
        *extra,
    ]


def read_metrics(output_dir: Path) -> list[dict]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def train_losses(output_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(output_dir) if "loss" in m}


def run(tmp_path, name, text_corpus, cache_dir, *extra):
    """Validate and launch a small run (ranks spawned as train.py would); returns
    (summary, output directory)."""
    out = tmp_path / name
    cfg = compose_config(small_run_overrides(out, text_corpus, cache_dir, *extra))
    validate(cfg)
    return launch(cfg), out


def reference_runs(tmp_path_factory, text_corpus, cache_dir, steps: int, *fixed: str):
    """``reference(model, *extra) -> output directory``: one single-process run per model and
    extra overrides, made on first use, with ``fixed`` overrides on every run (the
    tensor-parallel tests pad the vocabulary as tp pads it); for module-scoped fixtures."""
    runs = {}

    def get(model: str, *extra: str):
        key = (model, *extra)
        if key not in runs:
            tmp = tmp_path_factory.mktemp(f"reference_{model}")
            runs[key] = run(
                tmp,
                "single",
                text_corpus,
                cache_dir,
                f"model={model}",
                *fixed,
                "train.micro_batch_size=8",
                f"train.max_steps={steps}",
                *extra,
            )[1]
        return runs[key]

    return get


def assert_stage_estimates(summary: dict, *overrides: str) -> None:
    """``python -m llm.estimate`` per pipeline stage against a pp run made with
    ``overrides``: each rank's model states equal ``strategy.memory()`` exactly, and its
    activations (with the gathered weights autograd saves under FSDP2 and ``replicate``,
    which the tracker counts with them) are within 3% of the most the peak tracker saw live
    in a step (``activations_max``). The formula counts each micro-batch's token ids and
    targets apart; the run's are views of the whole batch, stored once (measured gaps: 0.4%
    at most)."""
    unused = Path("unused")
    cfg = compose_config(
        [*small_run_overrides(unused, unused, unused, *overrides), "estimate.device=cpu"]
    )
    args = model_args_for(cfg, vocab_size=257)  # the byte tokenizer's vocabulary
    for rank, measured in enumerate(summary["model_state_bytes"]):
        cfg.estimate.rank = rank
        stage = next(s for s in estimate(cfg, args).stages if s.rank == rank)
        assert {k: stage.device[k] for k in measured} == measured, f"rank {rank}"
        most = summary["memory_peak"][rank]["activations_max"]
        estimated = stage.device["activations"] + stage.device.get("gathered_weights", 0)
        assert estimated == pytest.approx(most, rel=0.03), f"rank {rank}: {estimated} vs {most}"


def final_weights(out):
    """The model weights of a run's last checkpoint, read back with DCP."""
    ckpt = sorted((out / "checkpoints").glob("step_*"))[-1]
    reader = dcp.FileSystemReader(str(ckpt))
    meta = reader.read_metadata()
    state = {
        k: torch.empty(v.size)
        for k, v in meta.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    dcp.load(state, storage_reader=reader)
    return state


def assert_close_weights(a, b, rtol, atol):
    assert a.keys() == b.keys() and a
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol, msg=key)


def grad_norms(out) -> dict[int, float]:
    return {m["step"]: m["grad_norm"] for m in read_metrics(out) if "grad_norm" in m}


def assert_run_matches(
    ref_out, out, steps: int, first_step: int = 1, weight_atol: float = 1e-5
) -> None:
    """A parallel run against one process: logged steps first_step..steps, losses and
    clipping norms within 1e-5 relative, final weights within 1e-4 relative and
    ``weight_atol`` absolute."""
    ref, got = train_losses(ref_out), train_losses(out)
    assert sorted(got) == list(range(first_step, steps + 1))
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    ref_norms, got_norms = grad_norms(ref_out), grad_norms(out)
    for step in got_norms:
        assert got_norms[step] == pytest.approx(ref_norms[step], rel=1e-5), step
    assert_close_weights(final_weights(ref_out), final_weights(out), rtol=1e-4, atol=weight_atol)


def zero_whole_weights(strategy) -> dict[str, torch.Tensor]:
    """Every parameter of our ZeRO strategy, all-gathered from the ranks' master shards."""
    out = {}
    for buf in strategy.buffers:
        full = buf.master.new_empty(buf.bucket.padded)
        dist.all_gather_into_tensor(full, buf.master.contiguous(), group=strategy.group)
        for slot in buf.bucket.slots:
            span = full[slot.offset : slot.offset + slot.numel]
            out[slot.name] = span.view(slot.param.shape).clone()
    return out


def one_line(exc_info) -> str:
    """The message of a raised error (a pytest.ExceptionInfo), checked to be one line."""
    message = str(exc_info.value)
    assert "\n" not in message and "Traceback" not in message
    return message
