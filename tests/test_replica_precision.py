"""Under every precision that runs on a CPU, DDP keeps its replicas equal: after each step
the gradients (averaged by DDP's reducer) and the weights are the same on every rank, also
under bf16_pure, whose rounded update must not detach the parameters from the reducer."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from llm.config import OptimizerConfig, ParallelismConfig, PrecisionConfig
from llm.models import build_model, materialize, model_args
from llm.parallel import ParallelDims, build_strategy
from llm.precision import apply_precision, build_loss_scaler, resolve_precision

# (precision, update_rounding): fp16 autocasts on CPU too.
PRECISIONS = [
    ("fp32", "stochastic"),
    ("bf16", "stochastic"),
    ("fp16", "stochastic"),
    ("bf16_pure", "stochastic"),
    ("bf16_pure", "kahan"),
]
STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same_on_every_rank(tensors: list[torch.Tensor]) -> bool:
    flat = torch.cat([t.detach().float().flatten() for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def _train(name: str, rounding: str, rank: int, world: int) -> list[tuple[bool, bool]]:
    device = torch.device("cpu")
    policy = resolve_precision(name, device, rounding)
    torch.manual_seed(0)  # the same init and stochastic-rounding noise on every rank
    model = build_model(model_args("gpt2-tiny", vocab_size=64))
    model = materialize(apply_precision(model, policy), device, 0)
    dims = ParallelDims.from_config(-1, 1, 1, world, rank)
    scaler = build_loss_scaler(PrecisionConfig(name=name), policy.loss_scaling)
    # Small buckets: several all-reduces per backward, as a real model has.
    strategy = build_strategy(
        ParallelismConfig(name="ddp", bucket_cap_mb=0.05), dims, policy, device, scaler
    )
    model = strategy.wrap(model)
    strategy.build_optimizer(model, OptimizerConfig(lr=1e-2))
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    checks = []
    for _ in range(STEPS):
        x = torch.randint(0, 64, (2, 16), generator=data)
        with strategy.micro_batch(sync=True):
            with policy.autocast(device):
                logits = model(x)
            strategy.backward(F.cross_entropy(logits.float().flatten(0, 1), x.flatten()))
        grads = [p.grad for p in model.parameters()]
        grads_equal = _same_on_every_rank(grads)
        strategy.clip_and_step(1.0)
        strategy.zero_grad()
        checks.append((grads_equal, _same_on_every_rank(list(model.parameters()))))
    assert strategy.take_sent() == {}  # counting is opt-in (parallelism.count_comm)
    return checks


def _rank(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        results[rank] = {
            f"{name}/{rounding}": _train(name, rounding, rank, world)
            for name, rounding in PRECISIONS
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_replicas_stay_equal_under_every_precision():
    world = 2
    results = mp.Manager().dict()
    mp.start_processes(
        _rank, args=(world, _free_port(), results), nprocs=world, start_method="spawn"
    )
    for key, checks in results[0].items():
        for step, (grads_equal, weights_equal) in enumerate(checks, start=1):
            assert grads_equal, f"{key}: gradients differ across ranks at step {step}"
            assert weights_equal, f"{key}: weights differ across ranks after step {step}"
