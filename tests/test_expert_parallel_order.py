"""Collective order under expert parallelism (issue 41, item 5; docs/parallel.md,
"Collective order under expert parallelism"): on a step that is neither logged nor a probe,
every rank issues the same collectives in the same order, across all its communicators:
the ep all-to-alls, the edp expert-gradient buckets and the strategy's dp reductions, read
from torch's flight recorder inside each rank (tests/collective_order_ranks.py). NCCL needs
each communicator's collectives in one order on every rank; one global order on every rank
also leaves no cycle of waits between communicators."""

from __future__ import annotations

import json

import pytest
from collective_order_ranks import ordered_main
from helpers import compose_config, small_run_overrides

from llm.data import prepare_data
from llm.launch.launcher import _spawn, prepare_for_ranks

RANKS, EP = 4, 2  # edp groups of 2: the expert buckets all-reduce over them


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp"])
def test_every_rank_issues_the_same_collectives_in_the_same_order(
    tmp_path, text_corpus, cache_dir, strategy
):
    out = tmp_path / "run"
    overrides = small_run_overrides(
        out, text_corpus, cache_dir, "model=moe-tiny", "model.moe.kernel=grouped",
        f"parallelism={strategy}", f"parallelism.ep_size={EP}",
        f"launcher.nproc_per_node={RANKS}", "train.micro_batch_size=1",
        # Small buckets: several expert buckets, launched during backward.
        "parallelism.bucket_cap_mb=0.1",
    )  # fmt: skip
    cfg = prepare_for_ranks(
        compose_config([*overrides, "train.max_steps=3", "train.log_every=100"])
    )
    prepare_data(cfg.data)
    _spawn(cfg, RANKS, ordered_main)
    orders = [
        json.loads((out / f"collective_order_rank{r}.json").read_text()) for r in range(RANKS)
    ]
    issued = {tuple(op) for op in orders[0]}
    assert ("gloo:all_to_all", "stride1") in issued  # the ep exchange
    # The expert gradients over edp: our buckets' all-reduces, or under fsdp its gathers
    # and reduce-scatters of the slices.
    assert any(group == "stride2" for _, group in issued)
    assert any(group == "dp" for _, group in issued)  # the strategy's own
    # Expert collectives go out between the all-to-alls of other layers.
    kinds = [group for _, group in orders[0]]
    first_edp = kinds.index("stride2")
    assert "stride1" in kinds[first_edp:], orders[0]
    for rank, order in enumerate(orders[1:], 1):
        assert order == orders[0], f"rank {rank} issued its collectives in another order"
