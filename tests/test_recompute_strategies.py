"""Every recompute policy under every strategy gives the weights a single process gets
without recompute. Driven through the strategy API in 2 spawned gloo ranks (the loop of
tests/test_optim_strategies.py, dropout 0 since ranks draw their own masks), and DeepSpeed
through train.py. Tolerance: as the optimizer parity tests, 1e-5 absolute on weights after
4 AdamW steps: only the order in which fp32 gradient sums are added differs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import run, train_losses
from test_optim_strategies import FAST_STEPS, WORLD, train

from llm.launch.launcher import free_port

POLICIES = ("full", "selective", "op_sac")
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def _ranks(rank: int, world: int, port: int, cases, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        for strategy, policy in cases:
            weights = train(strategy, "adamw", FAST_STEPS, rank, world, recompute=policy)
            if rank == 0:
                results[(strategy, policy)] = weights
    finally:
        dist.destroy_process_group()


def check_cases(cases: list[tuple[str, str]]) -> None:
    results = mp.Manager().dict()
    mp.start_processes(
        _ranks, args=(WORLD, free_port(), cases, results), nprocs=WORLD, start_method="spawn"
    )
    want = train("single", "adamw", FAST_STEPS)
    for case in cases:
        got = results[case]
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-5, msg=f"{case} {key}")


@pytest.mark.slow
def test_selective_and_op_sac_under_sharding_match_single():
    """Fast: the two new policies once each, under a gradient-sharding and a parameter-
    sharding strategy, in one spawn of 2 ranks."""
    check_cases([("zero2", "selective"), ("fsdp", "op_sac")])


@pytest.mark.slow
def test_every_policy_under_every_strategy_matches_single():
    check_cases([(s, p) for s in STRATEGIES for p in POLICIES])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_policy_under_deepspeed_matches_no_recompute(tmp_path, text_corpus, cache_dir, stage):
    """Losses over 4 AdamW steps against DeepSpeed without recompute, within 5e-5 relative:
    measured 1.3e-5 at step 3 for op_sac under stage 3 (full and selective within 1e-6 at
    every stage). Not yet traced to its source; the suspect is the order in which stage 3
    reduces the fp32 gradients that the recomputation hands it."""
    common = (
        "parallelism=deepspeed",
        f"parallelism.zero_stage={stage}",
        "launcher.nproc_per_node=2",
        "model.dropout=0.0",
        "train.max_steps=4",
    )
    _, plain = run(tmp_path, "none", text_corpus, cache_dir, "recompute=none", *common)
    ref = train_losses(plain)
    for policy in POLICIES:
        _, out = run(tmp_path, policy, text_corpus, cache_dir, f"recompute={policy}", *common)
        got = train_losses(out)
        assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=5e-5), (policy, step)
