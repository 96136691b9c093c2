"""An inf/nan gradient on ONE rank skips the step on every rank, under every strategy, and
changes nothing: weights, optimizer states and step counters stay bitwise equal."""

from __future__ import annotations

import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from llm.config import ParallelismConfig, PrecisionConfig
from llm.loss_scale import build_loss_scaler
from llm.models import build_model, materialize, model_args
from llm.parallel import ParallelDims, build_strategy
from llm.precision import resolve_precision

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step(strategy, model, x, poison: float):
    with strategy.micro_batch(sync=True):
        logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), x.flatten())
        strategy.backward(loss * poison)
    result = strategy.clip_and_step(1.0)
    strategy.zero_grad()
    return result


def _snapshot(strategy) -> dict:
    state = strategy.state_dict()
    flat = {f"model.{k}": v.clone() for k, v in state["model"].items()}
    for name, st in state["optimizer"]["state"].items():
        for key, value in st.items():
            flat[f"optim.{name}.{key}"] = torch.as_tensor(value).clone()
    return flat


def _rank(rank: int, world: int, port: int, name: str, poison: float, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        device = torch.device("cpu")
        torch.manual_seed(0)
        model = materialize(build_model(model_args("gpt2-tiny", vocab_size=64)), device, 0)
        precision_cfg = PrecisionConfig(name="fp16", loss_scaler="torch")
        policy = resolve_precision("fp16", device)
        strategy = build_strategy(
            ParallelismConfig(name=name, bucket_cap_mb=0.05),
            ParallelDims.from_config(-1, 1, 1, world, rank),
            policy,
            device,
            build_loss_scaler(precision_cfg, policy.loss_scaling),
        )
        model = strategy.wrap(model)
        strategy.build_optimizer(model, __import__("llm.config").config.OptimizerConfig(lr=1e-2))
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
        first = _step(strategy, model, x, 1.0)
        before = _snapshot(strategy)
        # Only rank 0's loss is poisoned; its inf/nan gradients must stop every rank.
        bad = _step(strategy, model, x, poison if rank == 0 else 1.0)
        after = _snapshot(strategy)
        unchanged = before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before
        )
        good = _step(strategy, model, x, 1.0)
        results[rank] = (
            first.skipped,
            bad.skipped,
            bad.loss_scale,
            unchanged,
            good.skipped,
            good.loss_scale,
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("poison", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("name", STRATEGIES)
def test_overflow_on_one_rank_skips_everywhere(name, poison):
    world = 2
    results = mp.Manager().dict()
    mp.start_processes(
        _rank, args=(world, _free_port(), name, poison, results), nprocs=world, start_method="spawn"
    )
    for rank in range(world):
        first_skipped, bad_skipped, scale, unchanged, good_skipped, next_scale = results[rank]
        assert not first_skipped and bad_skipped and not good_skipped, rank
        assert unchanged, f"rank {rank}: the skipped step changed weights or optimizer state"
        # torch preset: no hysteresis, so the overflow halves the scale at once.
        assert next_scale == scale / 2 == 2.0**15, rank
