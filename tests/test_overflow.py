"""An inf/nan gradient on ONE rank skips the step on every rank, under every strategy, and
changes nothing: weights, optimizer states and step counters stay bitwise equal."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import compose_config

from llm.config import OptimizerConfig, ParallelismConfig, PrecisionConfig
from llm.models import build_model, materialize, model_args
from llm.parallel import ParallelDims, build_strategy
from llm.parallel.flat_shards import FlatShard
from llm.parallel.step import overflow_checked_step
from llm.precision import build_loss_scaler, disabled_loss_scaler, resolve_precision

CPU = torch.device("cpu")
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp", "deepspeed1", "deepspeed2", "deepspeed3"]


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


def _local(value) -> torch.Tensor:
    """A copy of what this rank holds (DeepSpeed's checkpoint tensors are FlatShards)."""
    if isinstance(value, FlatShard):
        return torch.cat([torch.empty(0), *(v.flatten() for v in value.pieces.values())])
    return torch.as_tensor(value).clone()


def _snapshot(strategy) -> dict:
    state = strategy.state_dict()
    flat = {f"model.{k}": _local(v) for k, v in state["model"].items()}
    for name, st in state["optimizer"]["state"].items():
        for key, value in st.items():
            flat[f"optim.{name}.{key}"] = _local(value)
    return flat


def _build(name: str, world: int, rank: int, device: torch.device):
    """The strategy under fp16 with the torch preset; DeepSpeed (no fp16 on CPU, and built
    from a whole run config) under bf16, for which it checks overflow too."""
    dims = ParallelDims.from_config(-1, 1, 1, world, rank)
    if name.startswith("deepspeed"):
        os.environ["LOCAL_RANK"] = str(rank)  # as our launcher exports it
        cfg = compose_config(
            [
                "output_dir=unused",  # nothing is written: no Trainer runs
                "parallelism=deepspeed",
                f"parallelism.zero_stage={name[-1]}",
                "parallelism.bucket_cap_mb=0.05",
                "precision=bf16",
                "train.device=cpu",
                "train.micro_batch_size=2",
                "optimizer.lr=1e-2",
            ]
        )
        policy = resolve_precision("bf16", device)
        return build_strategy(cfg.parallelism, dims, policy, device, None, run_config=cfg)
    policy = resolve_precision("fp16", device)
    scaler = build_loss_scaler(PrecisionConfig(name="fp16", loss_scaler="torch"), True)
    return build_strategy(
        ParallelismConfig(name=name, bucket_cap_mb=0.05), dims, policy, device, scaler
    )


def _rank(rank: int, world: int, port: int, name: str, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        device = torch.device("cpu")
        torch.manual_seed(0)
        model = materialize(build_model(model_args("gpt2-tiny", vocab_size=64)), device, 0)
        strategy = _build(name, world, rank, device)
        model = strategy.wrap(model)
        strategy.build_optimizer(model, OptimizerConfig(lr=1e-2))
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
        first = _step(strategy, model, x, 1.0)
        skipped, unchanged, scales = [], [], [first.loss_scale]
        for poison in (math.inf, math.nan):
            before = _snapshot(strategy)
            # Only rank 0's loss is poisoned; its inf/nan gradients must stop every rank.
            bad = _step(strategy, model, x, poison if rank == 0 else 1.0)
            after = _snapshot(strategy)
            skipped.append(bad.skipped)
            unchanged.append(
                before.keys() == after.keys()
                and all(torch.equal(before[k], after[k]) for k in before)
            )
        good = _step(strategy, model, x, 1.0)
        scales.append(good.loss_scale)
        results[rank] = (first.skipped, skipped, unchanged, good.skipped, scales)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.slow
def test_overflow_on_one_rank_skips_everywhere(name):
    world = 2
    results = mp.Manager().dict()
    mp.start_processes(
        _rank, args=(world, _free_port(), name, results), nprocs=world, start_method="spawn"
    )
    for rank in range(world):
        first_skipped, skipped, unchanged, good_skipped, scales = results[rank]
        assert not first_skipped and skipped == [True, True] and not good_skipped, rank
        assert unchanged == [True, True], f"rank {rank}: a skipped step changed weights or state"
        if name.startswith("deepspeed"):  # bf16: skipped, but there is no scale to lower
            assert scales == [1.0, 1.0], rank
        else:  # torch preset: no hysteresis, so each overflow halves the scale at once
            assert scales == [2.0**16, 2.0**14], rank


def test_clipping_happens_on_the_device_and_the_norm_is_returned_unread():
    grads = [torch.tensor([3.0]), torch.tensor([4.0])]  # global norm 5
    steps = []
    result = overflow_checked_step(
        grads, 1.0, disabled_loss_scaler(), lambda: steps.append(1), list, CPU, grad_replicas=1
    )
    assert isinstance(result.grad_norm, torch.Tensor) and result.grad_norm.item() == 5.0
    torch.testing.assert_close(torch.cat(grads), torch.tensor([0.6, 0.8]))  # clipped to norm 1
    assert steps == [1] and not result.skipped
    # A non-finite gradient: the step is skipped and the gradients are left as they were.
    grads = [torch.tensor([math.inf]), torch.tensor([4.0])]
    result = overflow_checked_step(
        grads, 1.0, disabled_loss_scaler(), lambda: steps.append(1), list, CPU, grad_replicas=1
    )
    assert result.skipped and steps == [1] and grads[1].item() == 4.0
