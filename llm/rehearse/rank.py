"""Rehearse one rank: the run's config made a rehearsal's (fresh start, no checkpoints or
W&B, communication counted, probe and timed steps alternating), then llm.run.main as rank
``rehearse.rank`` of ``rehearse.world_size`` inside torch's fake process group."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from llm import run
from llm.config import Config
from llm.errors import ConfigError
from llm.parallel.dist import RankEnv
from llm.validate import validate


def refusal(cfg: Config) -> str | None:
    """Why ``cfg`` cannot be rehearsed, in one line, or None."""
    if cfg.parallelism.name == "deepspeed":
        return (
            "parallelism=deepspeed cannot be rehearsed: DeepSpeed's engine talks through its "
            "own deepspeed.comm, which torch's fake process group does not stand in for; "
            "rehearse zero1-3 (our ZeRO) for the same layout"
        )
    p = cfg.parallelism
    if p.pp_size > 1 and p.sequence_parallel:
        return (
            f"parallelism.pp_size={p.pp_size} with sequence_parallel=true cannot be "
            "rehearsed: a rehearsed stage answers for its neighbours' shapes with the whole "
            "sequence, and sequence parallel passes a tp rank's share of it between stages; "
            "rehearse the layout with sequence_parallel=false"
        )
    if cfg.checkpoint.resume not in ("auto", "none"):
        return (
            f"checkpoint.resume={cfg.checkpoint.resume} cannot be rehearsed: a rehearsal starts "
            "from initial weights (loading agrees on the checkpoint over object collectives, "
            "which carry nothing in the fake group); drop checkpoint.resume"
        )
    return None


def rehearsal_config(cfg: Config) -> Config:
    """``cfg`` as one rank of ``rehearse.world_size`` runs it here: rehearse.steps steps with
    probes (the peak tracker, comm counting) and timed steps alternating, no checkpoints,
    no W&B, no stop for non-finite gradients, the data cache's path absolute as the launcher
    makes it."""
    r = cfg.rehearse
    if r.world_size is None:
        raise ConfigError(
            "rehearse.world_size is not set; give the run's rank count, e.g. rehearse.world_size=16"
        )
    if why := refusal(cfg):
        raise ConfigError(why)
    return dataclasses.replace(
        cfg,
        launcher=dataclasses.replace(cfg.launcher, nproc_per_node=r.world_size),
        logger=dataclasses.replace(cfg.logger, mode="disabled", progress=False),
        checkpoint=dataclasses.replace(cfg.checkpoint, enabled=False, resume="none"),
        parallelism=dataclasses.replace(cfg.parallelism, count_comm=True),
        train=dataclasses.replace(
            cfg.train,
            max_steps=r.steps,
            stop_at_step=None,
            memory_tracking="alternate",
            eval_every=r.steps + 1,
        ),
        # The fake group's collectives leave their outputs as allocated (uninitialised), so
        # a gradient may come out inf or NaN: a rehearsal never stops for it.
        precision=dataclasses.replace(cfg.precision, max_overflows_at_min_scale=r.steps + 1),
        data=dataclasses.replace(cfg.data, cache_dir=str(Path(cfg.data.cache_dir).resolve())),
        output_dir=str(Path(cfg.output_dir).resolve()),
    )


def rehearse(cfg: Config) -> dict:
    """Run rank ``rehearse.rank`` of ``rehearse.world_size`` for ``rehearse.steps`` steps in
    this process; returns llm.run's summary (its per-rank lists hold this rank's figures)."""
    cfg = rehearsal_config(cfg)
    r = cfg.rehearse
    validate(cfg, world_size=r.world_size)
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    dist.init_process_group("fake", store=FakeStore(), rank=r.rank, world_size=r.world_size)
    try:
        return run.main(cfg, RankEnv(rank=r.rank, local_rank=0, world_size=r.world_size))
    finally:
        if dist.is_initialized():  # llm.run ends the group; a start-up that raised may not
            dist.destroy_process_group()
