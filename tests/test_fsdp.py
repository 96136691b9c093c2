"""parallelism=fsdp (torch's FSDP2) on gloo: parity with one process (ZeRO-3- and ZeRO-2-like,
HSDP, CPU offload, gradient accumulation, bf16), the bytes each rank holds and sends, and
checkpoints resumed on another world size.

Every run has the reference's global batch of 8 sequences (micro_batch_size = 8 / ranks), so
in fp32 the runs differ from it only in the order gradients are summed.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    assert_close_weights,
    assert_run_matches,
    final_weights,
    run,
    train_losses,
)

from llm.config import ParallelismConfig
from llm.errors import ConfigError
from llm.models import build_model, model_args, num_params
from llm.parallel import ParallelDims, build_strategy
from llm.precision import resolve_precision

STEPS = 20
BYTE_VOCAB = 257  # data.tokenizer=byte in the small test runs


def fsdp_run(tmp_path, name, text_corpus, cache_dir, ranks, *extra, accumulate=1):
    """``ranks`` FSDP ranks with the reference's global batch of 8 sequences."""
    return run(
        tmp_path,
        name,
        text_corpus,
        cache_dir,
        "parallelism=fsdp",
        f"launcher.nproc_per_node={ranks}",
        f"train.micro_batch_size={8 // (ranks * accumulate)}",
        f"train.grad_accum_steps={accumulate}",
        f"train.max_steps={STEPS}",
        "parallelism.count_comm=true",  # opt-in; the tests below read comm_bytes_per_step
        *extra,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir):
    """One process, global batch 8, fp32: what every FSDP run is compared with."""
    tmp = tmp_path_factory.mktemp("fsdp_reference")
    return run(
        tmp,
        "single",
        text_corpus,
        cache_dir,
        "train.micro_batch_size=8",
        f"train.max_steps={STEPS}",
    )


@pytest.fixture(scope="module")
def fsdp_on(tmp_path_factory, text_corpus, cache_dir):
    """Plain FSDP (reshard_after_forward=true) on ``ranks`` ranks, run once per module and
    checkpointed at step 10 too: ``fsdp_on(ranks) -> (summary, out)``."""
    runs = {}

    def get(ranks: int):
        if ranks not in runs:
            tmp = tmp_path_factory.mktemp(f"fsdp{ranks}")
            runs[ranks] = fsdp_run(
                tmp, "fsdp", text_corpus, cache_dir, ranks, f"checkpoint.every={STEPS // 2}"
            )
        return runs[ranks]

    return get


def assert_matches_reference(reference, out, first_step=1):
    # 1e-5 relative on losses, 1e-4 on weights: as DDP's parity test, the runs differ only in
    # how fp32 gradients are summed (per-rank partial sums averaged by a reduce-scatter).
    # The norm over every rank's local gradient shards (HSDP: divided by the replicas) is
    # the whole gradient's norm, so clipping acts as in one process.
    assert_run_matches(reference[1], out, STEPS, first_step)


def padded_bytes(params: list[torch.Tensor], ranks: int) -> int:
    """fp32 bytes of ``params`` with dim 0 padded to a multiple of ``ranks``, as FSDP2 pads
    every parameter so that all shards are equal: the size its collectives move."""
    return sum(
        math.ceil(p.shape[0] / ranks) * ranks * (p.numel() // p.shape[0]) * 4 for p in params
    )


def model_params(reference) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(root parameters, block parameters) of the test model, on the meta device."""
    args = model_args("gpt2-tiny", vocab_size=BYTE_VOCAB)
    assert num_params(args) == reference[0]["n_params"]
    named = list(build_model(args).named_parameters())  # the tied embedding once
    root = [p for name, p in named if not name.startswith("layers.")]
    blocks = [p for name, p in named if name.startswith("layers.")]
    return root, blocks


@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp_matches_single_process(reference, fsdp_on, ranks):
    summary, out = fsdp_on(ranks)
    assert summary["world_size"] == ranks and summary["strategy"] == "fsdp"
    assert_matches_reference(reference, out)


@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp_holds_a_shard_of_model_state(reference, fsdp_on, ranks):
    summary, _ = fsdp_on(ranks)
    root, blocks = model_params(reference)
    n = reference[0]["n_params"]
    single = reference[0]["model_state_bytes"][0]
    assert single["params"] == 4 * n
    for rank in summary["model_state_bytes"]:
        # Each parameter's shard is ceil(rows / N) rows (FSDP2 pads dim 0), so a rank holds
        # exactly the padded size / N of parameters and of gradients: 4Φ/N plus < 0.5%.
        assert rank["params"] == rank["grads"] == padded_bytes(root + blocks, ranks) // ranks
        assert rank["params"] == pytest.approx(4 * n / ranks, rel=5e-3)
        # AdamW's exp_avg and exp_avg_sq follow the unpadded local shard: 8Φ/N.
        assert rank["optimizer_states"] == pytest.approx(8 * n / ranks, rel=5e-3)
    # Together the shards are the whole: 8Φ, plus AdamW's scalar step counters, which every
    # rank keeps whole (the single process's states beyond 8Φ).
    steps_bytes = single["optimizer_states"] - 8 * n
    total = sum(rank["optimizer_states"] for rank in summary["model_state_bytes"])
    assert total == 8 * n + ranks * steps_bytes


@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp_gathers_blocks_twice_with_reshard_after_forward(reference, fsdp_on, ranks):
    summary, _ = fsdp_on(ranks)
    root, blocks = model_params(reference)
    for rank in summary["comm_bytes_per_step"]:
        # Blocks are gathered in forward, freed, and gathered again in backward; the root is
        # kept from its forward to its backward, so it is gathered once.
        assert rank["all_gather"] == padded_bytes(root, ranks) + 2 * padded_bytes(blocks, ranks)
        # Every gradient is reduce-scattered once, in fp32 (reduce_dtype).
        assert rank["reduce_scatter"] == padded_bytes(root + blocks, ranks)
        assert "all_reduce" not in rank


def test_fsdp_without_reshard_after_forward(tmp_path, reference, text_corpus, cache_dir):
    summary, out = fsdp_run(
        tmp_path, "zero2like", text_corpus, cache_dir, 2, "parallelism.reshard_after_forward=false"
    )
    assert_matches_reference(reference, out)
    every = padded_bytes([p for group in model_params(reference) for p in group], 2)
    for rank in summary["comm_bytes_per_step"]:
        # Parameters stay gathered from forward through backward: one all-gather each.
        assert rank == {"all_gather": every, "reduce_scatter": every}


def test_hsdp_two_replicas_of_two_shards(tmp_path, reference, text_corpus, cache_dir):
    summary, out = fsdp_run(tmp_path, "hsdp", text_corpus, cache_dir, 4, "parallelism.replicate=2")
    assert_matches_reference(reference, out)
    root, blocks = model_params(reference)
    every = padded_bytes(root + blocks, 2)
    for rank in summary["model_state_bytes"]:
        assert rank["params"] == every // 2  # sharded over the 2 ranks of a replica row
    for rank in summary["comm_bytes_per_step"]:
        # Collectives within a row of 2 as in 2-rank FSDP, then the reduce-scattered
        # gradient shard (half the padded bytes) is all-reduced across the 2 rows.
        assert rank == {
            "all_gather": padded_bytes(root, 2) + 2 * padded_bytes(blocks, 2),
            "reduce_scatter": every,
            "all_reduce": every // 2,
        }


def test_fsdp_offload_params(tmp_path, reference, text_corpus, cache_dir):
    _summary, out = fsdp_run(
        tmp_path, "offload", text_corpus, cache_dir, 2, "parallelism.offload_params=true"
    )
    assert_matches_reference(reference, out)


@pytest.mark.slow
def test_fsdp_gradient_accumulation_reduces_once(tmp_path, reference, text_corpus, cache_dir):
    summary, out = fsdp_run(tmp_path, "accumulate", text_corpus, cache_dir, 2, accumulate=2)
    assert_matches_reference(reference, out)
    root, blocks = model_params(reference)
    for rank in summary["comm_bytes_per_step"]:
        # Parameters are gathered for each micro-batch; gradients are reduce-scattered only
        # after the last one (set_requires_gradient_sync(False) before it).
        assert rank["all_gather"] == 2 * (padded_bytes(root, 2) + 2 * padded_bytes(blocks, 2))
        assert rank["reduce_scatter"] == padded_bytes(root + blocks, 2)


def test_fsdp_bf16_tracks_fp32_reference(tmp_path, reference, text_corpus, cache_dir):
    summary, out = fsdp_run(tmp_path, "bf16", text_corpus, cache_dir, 2, "precision=bf16")
    ref, got = train_losses(reference[1]), train_losses(out)
    # bf16 keeps 8 bits of mantissa (relative rounding ~4e-3) in weights gathered for compute
    # and in activations; fp32 shards, gradient reduction and AdamW keep the runs together:
    # measured at most 9e-4 relative over 20 steps, so 1e-2 leaves room yet catches a
    # diverging run (the loss falls by 30% over these steps).
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-2), step
    root, blocks = model_params(reference)
    for rank in summary["comm_bytes_per_step"]:
        # Parameters are gathered in bf16 (half the fp32 bytes); gradients reduced in fp32.
        assert rank["all_gather"] == (padded_bytes(root, 2) + 2 * padded_bytes(blocks, 2)) // 2
        assert rank["reduce_scatter"] == padded_bytes(root + blocks, 2)


@pytest.mark.parametrize(("saved_by", "resumed_by"), [(2, 4), (2, 1), (4, 2)])
def test_checkpoint_resumes_on_another_world_size(
    tmp_path, reference, fsdp_on, text_corpus, cache_dir, saved_by, resumed_by
):
    """The step-10 checkpoint of an FSDP run on ``saved_by`` ranks, resumed on ``resumed_by``:
    DCP reshards the DTensors on load, and steps 11-20 continue the uninterrupted run."""
    _, saved = fsdp_on(saved_by)
    checkpoint = saved / "checkpoints" / f"step_{STEPS // 2:06d}"
    summary, out = fsdp_run(
        tmp_path, "resumed", text_corpus, cache_dir, resumed_by, f"checkpoint.resume={checkpoint}"
    )
    assert summary["steps"] == STEPS and summary["world_size"] == resumed_by
    # The same tolerances as uninterrupted runs: resuming adds no error of its own.
    assert_matches_reference(reference, out, first_step=STEPS // 2 + 1)


def test_impossible_fsdp_setups_are_refused():
    # Checked when the strategy is built, before any mesh or process group exists.
    device = torch.device("cpu")
    message = r"parallelism.replicate=3 \(HSDP\) must divide the 4 data-parallel ranks"
    with pytest.raises(ConfigError, match=message):
        build_strategy(
            ParallelismConfig(name="fsdp", replicate=3),
            ParallelDims.from_config(-1, 1, 1, world_size=4),
            resolve_precision("fp32", device),
            device,
        )


def test_fsdp_bf16_pure_matches_single_process(tmp_path, text_corpus, cache_dir):
    """bf16 shards stepped by the rounded update (Kahan: deterministic) track one process
    under the same precision; only the order of bf16 gradient sums differs."""
    pure = ("precision=bf16_pure", "precision.update_rounding=kahan")
    single, single_out = run(
        tmp_path,
        "single",
        text_corpus,
        cache_dir,
        "train.micro_batch_size=8",
        f"train.max_steps={STEPS}",
        *pure,
    )
    summary, out = fsdp_run(
        tmp_path, "fsdp", text_corpus, cache_dir, 2, *pure, "parallelism.count_comm=false"
    )
    # Counting is opt-in: not measured, and the summary says why.
    assert summary["comm_bytes_per_step"] == [None, None]
    assert "parallelism.count_comm=false" in summary["comm_bytes_note"]
    ref, got = train_losses(single_out), train_losses(out)
    # Measured at most 1e-4 relative over 20 steps.
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-3), step
    # Weights within a few bf16 ulps (2^-8 relative; measured at most 9.4e-3 absolute):
    # gradients are summed in bf16 in another order, and a Kahan step can round the other way.
    assert_close_weights(final_weights(single_out), final_weights(out), rtol=2**-6, atol=2e-2)
    n = single["n_params"]
    for rank in summary["model_state_bytes"]:
        assert rank["params"] == pytest.approx(2 * n / 2, rel=5e-3)  # bf16 shards
