"""Data parallel over each pipeline stage's dp group (dp=2 x pp=2, 4 gloo ranks): our ZeRO
stages and ddp against one process, fp32, same seed and data.

Every run has the reference's global batch of 8 sequences of 64 byte tokens: each dp rank
reads 4, split into pipeline micro-batches of 2 (pp_microbatches=2). Only the order of
additions differs from one process (micro-batch gradients accumulated or reduced one by
one, the dp reduction, the tied embedding's two halves meeting in an all-reduce), hence the
pipeline tests' tolerance (``helpers.assert_run_matches``): 1e-5 relative on losses and
clipping norms, 1e-4 relative + 1e-5 absolute on final weights.
"""

from __future__ import annotations

import pytest
from helpers import (
    assert_run_matches,
    assert_stage_estimates,
    final_weights,
    read_metrics,
    reference_runs,
    run,
    train_losses,
)

STEPS = 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir):
    return reference_runs(tmp_path_factory, text_corpus, cache_dir, STEPS)


def dp_pp_overrides(strategy, *extra, nproc=4) -> list[str]:
    """gpt2-tiny (tied embedding split over the stages) under ``strategy`` on dp x pp=2,
    small buckets (several per stage, pieces cut mid-parameter)."""
    return [
        f"parallelism={strategy}",
        f"launcher.nproc_per_node={nproc}",
        "parallelism.pp_size=2",
        "parallelism.bucket_cap_mb=0.05",
        "train.micro_batch_size=4",
        f"train.max_steps={STEPS}",
        *extra,
    ]


def dp_pp_run(tmp_path, text_corpus, cache_dir, strategy, *extra, nproc=4, name="dp_pp"):
    overrides = dp_pp_overrides(strategy, *extra, nproc=nproc)
    return run(tmp_path, name, text_corpus, cache_dir, *overrides)


def stage_params(out) -> list[int]:
    """Parameters of each stage of gpt2-tiny at pp=2, from the whole model's checkpoint: the
    embeddings and block 0, then block 1, the final norm and the head (the tied copy)."""
    weights = final_weights(out)
    first = ("model.tok_embeddings.", "model.pos_embeddings.", "model.layers.0.")
    n0 = sum(w.numel() for k, w in weights.items() if k.startswith(first))
    return [n0, sum(w.numel() for w in weights.values()) - n0]


@pytest.mark.slow
def test_zero2_data_parallel_pipeline_matches_single_process(
    tmp_path, reference, text_corpus, cache_dir
):
    """zero2 reduce-scatters each micro-batch's gradients over the stage's dp group; the
    tied embedding's copies (their own bucket, split alike at both ends) add their shards.
    Each rank holds its stage's Φ_s parameters whole (the working copy, fp32 here) and half
    of its stage's gradients and AdamW moments: 4Φ_s + 4Φ_s/2 + 8Φ_s/2 bytes, each bucket
    padded to a multiple of the 2 dp ranks."""
    summary, out = dp_pp_run(tmp_path, text_corpus, cache_dir, "zero2")
    assert (summary["dp_size"], summary["pp_size"]) == (2, 2)
    assert_run_matches(reference("gpt2-tiny"), out, STEPS)
    phi = stage_params(out)
    last = [m for m in read_metrics(out) if "loss" in m and m["probe"]][-1]
    for rank, peak in enumerate(last["memory_peak"]):  # ranks 0-1: stage 0, 2-3: stage 1
        padding = peak["params"] - 4 * phi[rank // 2]
        assert 0 <= padding < 1024, rank
    # Rank 0's model state after the step (stage 0): half the working bytes each, the
    # moments twice that, plus AdamW's step counters.
    params, grads = last["memory/params_bytes"], last["memory/grads_bytes"]
    assert params == 2 * grads and 0 <= params - 4 * phi[0] < 1024
    assert 0 <= last["memory/optimizer_states_bytes"] - 2 * grads < 1024
    # The estimator: the same buckets (the head copy's alone) on every rank, exactly.
    assert_stage_estimates(summary, *dp_pp_overrides("zero2"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "schedule"),
    [("ddp", "1f1b"), ("zero1", "1f1b"), ("zero3", "1f1b"), ("zero3", "gpipe"), ("ddp", "gpipe")],
)
def test_data_parallel_pipelines_match_single_process(
    tmp_path, reference, text_corpus, cache_dir, strategy, schedule
):
    """ddp: torch's replicate on each stage, all-reduced at the step's last backward;
    zero1: the full gradient buckets reduce-scattered once, at the step's last backward;
    zero3: blocks gathered per micro-batch, the head kept gathered until the step's last
    backward (GPipe runs every forward before the first backward). The estimate per stage
    equals what each rank measured; under ddp with the weights the matmuls and norms save,
    which are ``replicate``'s gathered storages (FSDP2's machinery), not the parameters
    ``strategy.memory()`` names (the estimate's ``gathered_weights``)."""
    extra = f"parallelism.pp_schedule={schedule}"
    summary, out = dp_pp_run(tmp_path, text_corpus, cache_dir, strategy, extra)
    assert_run_matches(reference("gpt2-tiny"), out, STEPS)
    assert_stage_estimates(summary, *dp_pp_overrides(strategy, extra))


@pytest.mark.slow
def test_zero1_pipeline_accumulates_loader_batches(tmp_path, reference, text_corpus, cache_dir):
    """Two loader batches of 2 per dp rank and step (two schedule steps): zero1 reduces once,
    after the second one's last backward."""
    _, out = dp_pp_run(
        tmp_path,
        text_corpus,
        cache_dir,
        "zero1",
        "train.micro_batch_size=2",
        "train.grad_accum_steps=2",
    )
    assert_run_matches(reference("gpt2-tiny"), out, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero2", "ddp"])
def test_data_parallel_tensor_pipeline(tmp_path, reference, text_corpus, cache_dir, strategy):
    """dp=2 x tp=2 x pp=2 on 8 ranks: each stage's part split by tensor parallel, our ZeRO
    bucketing each DTensor's local block over the stage's dp group (ddp: replicate on the
    dp sub-mesh). tp pads the vocabulary to 258; the reference pads the same way."""
    tp = "parallelism.tp_size=2"
    summary, out = dp_pp_run(tmp_path, text_corpus, cache_dir, strategy, tp, nproc=8)
    assert (summary["dp_size"], summary["tp_size"], summary["pp_size"]) == (2, 2, 2)
    assert_run_matches(reference("gpt2-tiny", "model.vocab_multiple=2"), out, STEPS)
    assert_stage_estimates(summary, *dp_pp_overrides(strategy, tp, nproc=8))


@pytest.mark.slow
def test_zero_checkpoints_move_between_pipeline_and_one_process(
    tmp_path, reference, text_corpus, cache_dir
):
    """A zero2 dp=2 x pp=2 run saved at step 2 resumes in one process, and a one-process
    checkpoint resumes at zero2 dp=2 x pp=2: steps 3-4 equal the uninterrupted run either
    way. The pieces are saved under the whole model's names, the head copy's optimizer
    state under the embedding's."""
    half = f"checkpoint.every={STEPS // 2}"
    one_process = ("train.micro_batch_size=8", f"train.max_steps={STEPS}")
    _, pp_out = dp_pp_run(tmp_path, text_corpus, cache_dir, "zero2", half, name="pp")
    _, single_out = run(tmp_path, "single", text_corpus, cache_dir, *one_process, half)
    step = f"step_{STEPS // 2:06d}"
    resume_from_pp = f"checkpoint.resume={pp_out / 'checkpoints' / step}"
    _, resumed_single = run(
        tmp_path, "resumed_single", text_corpus, cache_dir, *one_process, resume_from_pp
    )
    resume_from_single = f"checkpoint.resume={single_out / 'checkpoints' / step}"
    _, resumed_pp = dp_pp_run(
        tmp_path, text_corpus, cache_dir, "zero2", resume_from_single, name="resumed_pp"
    )
    for out in (resumed_single, resumed_pp):
        assert_run_matches(reference("gpt2-tiny"), out, STEPS, first_step=STEPS // 2 + 1)


# fp16 with our dynamic loss scaler, started where gpt2-tiny's gradients overflow within a
# few steps, doubled after every clean step and halved at once on an overflow.
FP16 = (
    "precision=fp16",
    "precision.initial_scale=131072",
    "precision.growth_interval=1",
    "precision.hysteresis=1",
    "train.max_steps=8",
)


def _scaler_trace(out) -> list[tuple]:
    return [(m["loss_scale"], m["skipped"]) for m in read_metrics(out) if "loss" in m]


@pytest.mark.slow
def test_fp16_overflow_is_decided_over_every_stage(tmp_path, text_corpus, cache_dir):
    """The step is skipped on every rank when any stage's gradients overflow: the decision
    reads the gradient norm all-reduced over every stage and dp rank. zero2 over dp=2 x
    pp=2 logs the loss-scale trace and skipped steps of zero2 over dp=2 alone with the same
    micro-batches of 2 (overflows at steps 3, 6 and 7), and its losses stay equal to it
    after them: a stage that stepped while the other skipped would part the losses. (Our
    ZeRO keeps fp16 gradients, so it overflows at scales where one process's fp32 gradients
    do not: the reference is ZeRO's own run.) pp=2 alone (fp32 gradients) follows one
    process the same way."""
    pp = dp_pp_run(tmp_path, text_corpus, cache_dir, "zero2", *FP16, name="zero2_pp")[1]
    dp = run(
        tmp_path,
        "zero2_dp",
        text_corpus,
        cache_dir,
        *FP16,
        "parallelism=zero2",
        "launcher.nproc_per_node=2",
        "train.micro_batch_size=2",
        "train.grad_accum_steps=2",
    )[1]
    assert _scaler_trace(pp) == _scaler_trace(dp)
    assert sum(skipped for _, skipped in _scaler_trace(pp)) >= 2
    assert train_losses(pp) == pytest.approx(train_losses(dp), rel=1e-5)

    pp_alone = ("launcher.nproc_per_node=2", "parallelism.pp_size=2", "train.micro_batch_size=8")
    single = ("train.micro_batch_size=2", "train.grad_accum_steps=4")
    pp = run(
        tmp_path, "pp", text_corpus, cache_dir, *FP16, *pp_alone, "parallelism.pp_microbatches=4"
    )[1]
    one = run(tmp_path, "single", text_corpus, cache_dir, *FP16, *single)[1]
    assert _scaler_trace(pp) == _scaler_trace(one)
    assert sum(skipped for _, skipped in _scaler_trace(pp)) >= 1
    assert train_losses(pp) == pytest.approx(train_losses(one), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_zero3_pipeline_under_recompute(tmp_path, reference, text_corpus, cache_dir, recompute):
    """zero3 gathers a block's parameters again for the recomputed forward inside its
    backward; under 1f1b over dp=2 x pp=2 the run still equals one process, and the estimate
    per stage (the recompute policy's activations) equals what each rank measured."""
    extra = f"recompute={recompute}"
    summary, out = dp_pp_run(tmp_path, text_corpus, cache_dir, "zero3", extra)
    assert_run_matches(reference("gpt2-tiny"), out, STEPS)
    assert_stage_estimates(summary, *dp_pp_overrides("zero3", extra))


@pytest.mark.slow
def test_hsdp_pipeline_matches_single_process(tmp_path, reference, text_corpus, cache_dir):
    """fsdp with parallelism.replicate=2 (HSDP) over each stage's dp ranks: dp=4 as 2
    replicas x 2 shards, x pp=2 on 8 ranks, each dp rank reading 2 of the batch of 8."""
    extra = ("parallelism=fsdp", "parallelism.replicate=2", "train.micro_batch_size=2")
    summary, out = dp_pp_run(tmp_path, text_corpus, cache_dir, "fsdp", *extra, nproc=8)
    assert (summary["dp_size"], summary["pp_size"]) == (4, 2)
    assert_run_matches(reference("gpt2-tiny"), out, STEPS)
    assert_stage_estimates(summary, *dp_pp_overrides("fsdp", *extra, nproc=8))
