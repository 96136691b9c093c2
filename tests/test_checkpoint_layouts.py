"""One run's checkpoints moving between 2-D layouts (issue 14): saved at dp=2 x tp=2 under
FSDP2, resumed at tp=2 x pp=2 and in one process, and from tp=2 x pp=2 back to dp=2 x tp=2
under FSDP2. Every resumed step equals an uninterrupted single-process run's.

gpt2-tiny (the tied embedding is one DTensor at dp x tp, and two copies on the two stages at
tp x pp), fp32, the global batch of 8 sequences of 64 byte tokens (each dp rank reads 4), the
vocabulary at 258 in every run (tp=2 pads the byte tokenizer's 257 to 258, and a checkpoint
moves only between equal shapes). The layouts differ from one process only in the order
partial sums are added, hence helpers.assert_run_matches' tolerance: 1e-5 relative on losses
and clipping norms, 1e-4 relative + 1e-5 absolute on final weights.
"""

from __future__ import annotations

import pytest
from helpers import assert_run_matches, reference_runs, run, train_losses

STEPS = 3
VOCAB = "model.vocab_size=258"
FIXED = ("model=gpt2-tiny", VOCAB, f"train.max_steps={STEPS}")
DP2_TP2 = ("parallelism=fsdp", "parallelism.tp_size=2", "launcher.nproc_per_node=4")
TP2_PP2 = (
    "parallelism=single",
    "parallelism.tp_size=2",
    "parallelism.pp_size=2",
    "launcher.nproc_per_node=4",
)


def checkpoint(out, step: int):
    return out / "checkpoints" / f"step_{step:06d}"


@pytest.mark.slow
def test_checkpoints_move_between_dp_tp_tp_pp_and_one_process(
    tmp_path, tmp_path_factory, text_corpus, cache_dir
):
    reference = reference_runs(tmp_path_factory, text_corpus, cache_dir, STEPS, VOCAB)
    ref = reference("gpt2-tiny")

    def layout_run(name, *extra):
        summary, out = run(tmp_path, name, text_corpus, cache_dir, *FIXED, *extra)
        assert summary["skipped_steps"] == 0
        return summary, out

    # dp=2 x tp=2 (FSDP2 shards each tp block over dp) saves after step 1 and stops.
    summary, dp_tp = layout_run(
        "dp2_tp2",
        *DP2_TP2,
        "train.micro_batch_size=4",
        "train.stop_at_step=1",  # the schedule still spans STEPS
        "checkpoint.every=1",
    )
    assert (summary["dp_size"], summary["tp_size"], summary["pp_size"]) == (2, 2, 1)
    assert train_losses(dp_tp)[1] == pytest.approx(train_losses(ref)[1], rel=1e-5)

    # tp=2 x pp=2 reads it (each stage its blocks' tp shards, the head copy from the
    # embedding's) and runs steps 2-3, saving after each.
    summary, tp_pp = layout_run(
        "tp2_pp2",
        *TP2_PP2,
        "train.micro_batch_size=8",
        "checkpoint.every=1",
        f"checkpoint.resume={checkpoint(dp_tp, 1)}",
    )
    assert (summary["dp_size"], summary["tp_size"], summary["pp_size"]) == (1, 2, 2)
    assert_run_matches(ref, tp_pp, STEPS, first_step=2)

    # One process reads the dp=2 x tp=2 checkpoint whole.
    _, single = layout_run(
        "single", "train.micro_batch_size=8", f"checkpoint.resume={checkpoint(dp_tp, 1)}"
    )
    assert_run_matches(ref, single, STEPS, first_step=2)

    # And back: dp=2 x tp=2 reads tp=2 x pp=2's checkpoint after step 2 and runs step 3.
    _, back = layout_run(
        "dp2_tp2_again",
        *DP2_TP2,
        "train.micro_batch_size=4",
        f"checkpoint.resume={checkpoint(tp_pp, 2)}",
    )
    assert_run_matches(ref, back, STEPS, first_step=3)
