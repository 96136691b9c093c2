"""A rank's main for tests/test_expert_parallel_order.py: llm.run.main with torch's flight
recorder on (it logs every collective a process group issues, gloo's included, in issue
order), and the collectives of one step that is neither logged nor a probe written to the
run directory as collective_order_rank{N}.json. Spawned ranks import it by name, so it
lives in a module of its own."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace
from torch.distributed.distributed_c10d import _world

from llm import run
from llm.parallel.dist import RankEnv
from llm.train.trainer import Trainer

STEP = 3  # not logged, not a probe (the test's train.log_every is above the run's steps)


def _trace() -> dict:
    return pickle.loads(_dump_fr_trace())


def _label(ranks: list[int], world: int) -> str:
    """A group named by its shape, the same on every rank: ``dp`` (every rank), else
    ``stride{s}`` (ep groups are neighbouring ranks, stride 1; edp groups stride ep)."""
    if len(ranks) == world:
        return "dp"
    return f"stride{ranks[1] - ranks[0]}" if len(ranks) > 1 else "self"


def ordered_main(cfg, env: RankEnv) -> dict:
    """Record the collectives issued during train step ``STEP``: (op, group label) each."""
    os.environ["TORCH_FR_BUFFER_SIZE"] = "100000"  # read when the process groups are made
    issued: list[list[str]] = []
    train_step = Trainer.train_step

    def recorded_step(self, timer, stop):
        if self.state.step + 1 != STEP:
            return train_step(self, timer, stop)
        before = {e["record_id"] for e in _trace()["entries"]}
        out = train_step(self, timer, stop)
        trace = _trace()
        world = dist.get_world_size()
        groups = {
            name: _label(sorted(dist.get_process_group_ranks(group)), world)
            for group, name in _world.pg_names.items()
        }
        issued[:] = [
            [e["profiling_name"], groups[e["process_group"][0]]]
            for e in trace["entries"]
            if e["record_id"] not in before
        ]
        return out

    Trainer.train_step = recorded_step
    try:
        summary = run.main(cfg, env)
    finally:
        Trainer.train_step = train_step
    Path(cfg.output_dir, f"collective_order_rank{env.rank}.json").write_text(json.dumps(issued))
    return summary
