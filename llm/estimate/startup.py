"""The estimate train.py prints before a run starts (meta-device arithmetic, no memory),
and its one-line warning on CUDA when the run will not fit the device."""

from __future__ import annotations

import dataclasses
import logging

import torch

from llm.build import model_args_for, resolve_device, tokenizer_vocab_size
from llm.config import Config
from llm.estimate.estimator import GIB, estimate
from llm.estimate.report import PEAK_AT, human, largest_stage
from llm.logging import say


def _rows(device: dict[str, int]) -> str:
    parts = ", ".join(f"{k} {human(v)}" for k, v in device.items())
    return f"{parts}; total {human(sum(device.values()))}"


def announce_estimate(cfg: Config, world: int) -> None:
    """One line of per-rank bytes at the moment of the step that sets the peak (under
    pipeline parallel one per stage, and which sets the peak); on CUDA, a warning when the
    largest total passes the device's."""
    device = resolve_device(cfg)
    est_cfg = dataclasses.replace(cfg.estimate, device=device.type, nodes=1, gpus_per_node=world)
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
        est_cfg.device_memory_gb = memory / GIB
    run = dataclasses.replace(cfg, estimate=est_cfg)
    est = estimate(run, model_args_for(cfg, vocab_size=tokenizer_vocab_size(cfg)))
    if est.stages is None:
        at = f" ({PEAK_AT[est.peak_moment]})" if est.peak_moment in PEAK_AT else ""
        say(f"estimate per rank: {_rows(est.peak_rows)}{at} (python -m llm.estimate)", stdout=True)
    else:
        for stage in est.stages:
            name = f"pipeline stage {stage.pp_rank} (rank {stage.rank})"
            say(f"estimate {name}: {_rows(stage.device)}", stdout=True)
        say(f"estimate: {largest_stage(est)} (python -m llm.estimate)", stdout=True)
    if device.type == "cuda" and not est.fits:
        say(
            f"warning: the estimate {human(est.total)} exceeds this GPU's "
            f"{human(est.device_memory)}; try python -m llm.estimate estimate.plan=true",
            logging.WARNING,
        )
