"""Pipeline parallelism on gloo against one process, fp32, same seed and data.

Every run has the reference's global batch of 8 sequences of 64 byte tokens, split into
pipeline micro-batches of 4 (pp_microbatches=2) or 2. The pipelined step sums the same
per-token losses into the same gradients; only the order of additions differs (micro-batch
gradients are accumulated one by one, and a tied embedding's two halves meet in an
all-reduce), hence 1e-5 relative on losses and clipping norms, 1e-4 / 1e-5 on weights
(``helpers.assert_run_matches``).
"""

from __future__ import annotations

import pytest
from helpers import (
    assert_run_matches,
    assert_stage_estimates,
    compose_config,
    one_line,
    reference_runs,
    run,
    small_run_overrides,
    train_losses,
)

from llm.config import ParallelismConfig
from llm.errors import ConfigError
from llm.models import model_args
from llm.parallel.pipeline import PipelineLayout
from llm.validate import validate

STEPS = 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir):
    """One process per model shape: ``reference(model, *extra) -> output directory``."""
    return reference_runs(tmp_path_factory, text_corpus, cache_dir, STEPS)


def pp_overrides(model, schedule, *extra, nproc=2) -> list[str]:
    return [
        f"model={model}",
        f"launcher.nproc_per_node={nproc}",
        "parallelism.pp_size=2",
        f"parallelism.pp_schedule={schedule}",
        "train.micro_batch_size=8",
        f"train.max_steps={STEPS}",
        *extra,
    ]


def pp_run(tmp_path, text_corpus, cache_dir, model, schedule, *extra, nproc=2, name="pp"):
    overrides = pp_overrides(model, schedule, *extra, nproc=nproc)
    return run(tmp_path, name, text_corpus, cache_dir, *overrides)


MICROBATCHES = 4
GPT2_1F1B = (
    "gpt2-tiny",
    "1f1b",
    f"parallelism.pp_microbatches={MICROBATCHES}",
    "parallelism.count_comm=true",
)


@pytest.fixture(scope="module")
def gpt2_1f1b(tmp_path_factory, text_corpus, cache_dir):
    """gpt2-tiny at pp=2 under 1f1b with 4 micro-batches, its sends counted."""
    return pp_run(tmp_path_factory.mktemp("pp_gpt2"), text_corpus, cache_dir, *GPT2_1F1B)


def test_1f1b_matches_single_process(reference, gpt2_1f1b):
    """The tied embedding is split over the two stages (a copy on each, their gradients
    summed before the step)."""
    summary, out = gpt2_1f1b
    assert summary["pp_size"] == 2 and summary["dp_size"] == 1
    assert_run_matches(reference("gpt2-tiny"), out, STEPS)


def test_estimate_per_stage_equals_measured(gpt2_1f1b):
    """Stage 0 holds the embeddings and block 0 with 2 micro-batches of 2 in flight, stage
    1 block 1, the final norm, a copy of the tied head and the loss with 1."""
    summary, _ = gpt2_1f1b
    assert_stage_estimates(summary, *pp_overrides(*GPT2_1F1B))


def test_stage_boundary_carries_bsh_per_microbatch(gpt2_1f1b):
    """Per step, the first stage sends each micro-batch's (b, s, h) activations forward and
    the last sends their gradient back: m x b x s x h x 4 bytes each way (fp32), b = 8 / m."""
    summary, _ = gpt2_1f1b
    b, s, h = 8 // MICROBATCHES, 64, model_args("gpt2-tiny").d_model
    each_way = MICROBATCHES * b * s * h * 4
    assert summary["comm_bytes_per_step"] == [
        {"pp.send_activations": each_way},
        {"pp.send_gradients": each_way},
    ]


@pytest.mark.parametrize(
    ("model", "schedule"),
    [
        ("llama-tiny", "gpipe"),
        pytest.param("gpt2-tiny", "gpipe", marks=pytest.mark.slow),
        pytest.param("llama-tiny", "1f1b", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_pipeline_matches_single_process(
    tmp_path, reference, text_corpus, cache_dir, model, schedule
):
    """llama-tiny: untied head, RMSNorm, RoPE, GQA; 2 micro-batches (one per stage). The
    estimate per stage equals what each rank measured."""
    summary, out = pp_run(tmp_path, text_corpus, cache_dir, model, schedule)
    assert summary["pp_size"] == 2
    assert_run_matches(reference(model), out, STEPS)
    assert_stage_estimates(summary, *pp_overrides(model, schedule))


def test_balanced_stages_and_placements():
    """Blocks split evenly, the remainder on the first stages; looped schedules place
    stage s on rank s % pp, the V-shaped ones rank r's stages at r and 2p-1-r."""
    layout = PipelineLayout(n_layers=7, pp_size=2, virtual_stages=2, schedule="interleaved_1f1b")
    assert layout.stage_blocks() == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert [layout.stages_of(r) for r in (0, 1)] == [(0, 2), (1, 3)]
    v = PipelineLayout(n_layers=4, pp_size=2, virtual_stages=2, schedule="zbv_zero_bubble")
    assert [v.stages_of(r) for r in (0, 1)] == [(0, 3), (1, 2)]
    split = PipelineLayout(n_layers=4, pp_size=2, virtual_stages=1, schedule="1f1b", split=(3,))
    assert split.stage_blocks() == [range(0, 3), range(3, 4)]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["parallelism.pp_size=4", "launcher.nproc_per_node=4"],
            "model.n_layers=2 is fewer than the 4 pipeline stages",
        ),
        (
            ["parallelism.pp_microbatches=3"],
            "train.micro_batch_size=4 is not divisible by the 3 pipeline micro-batches",
        ),
        (
            ["parallelism.pp_microbatches=1"],
            "1f1b needs at least as many micro-batches as stages",
        ),
        (
            ["parallelism.pp_schedule=interleaved_1f1b"],
            "interleaves several stages per rank; set parallelism.pp_virtual_stages >= 2",
        ),
        (
            ["parallelism.pp_schedule=zbv_zero_bubble", "parallelism.pp_virtual_stages=3"],
            "places exactly 2 stages per rank in a V",
        ),
        (["parallelism.pp_virtual_stages=2"], "1f1b runs one stage per rank"),
        (
            [
                "model.n_layers=6",
                "parallelism.pp_schedule=interleaved_1f1b",
                "parallelism.pp_virtual_stages=2",
                "parallelism.pp_microbatches=5",
                "train.micro_batch_size=5",
            ],
            "pp_microbatches=5 is not a multiple of 2 rounds",
        ),
        (
            [
                "model.n_layers=4",
                "parallelism.pp_schedule=dualpipev",
                "parallelism.pp_virtual_stages=2",
            ],
            "dualpipev needs at least as many micro-batches as its 4 stages",
        ),
        (["parallelism.pp_split=[2]"], "parallelism.pp_split=[2] must name 1 increasing"),
        (
            ["data.packing=true", "attention.document_mask=true"],
            "document ids are not passed between pipeline stages",
        ),
        (["optimizer=sophia"], "its extra gradient pass is not run through the pipeline"),
        (["train.compile=true"], "the stage modules are not compiled here"),
        (
            [
                "parallelism=zero2",
                "model.n_layers=4",
                "parallelism.pp_schedule=interleaved_1f1b",
                "parallelism.pp_virtual_stages=2",
            ],
            "our ZeRO buckets one stage per rank",
        ),
        (["parallelism=deepspeed"], "parallelism=deepspeed with pp_size=2"),
        (
            ["launcher.nproc_per_node=4", "parallelism=single"],
            "tp_size x pp_size = 2) but 4 ranks were asked for",
        ),
        (
            ["launcher.nproc_per_node=4", "parallelism=fsdp", "parallelism.dp_size=3"],
            "dp_size*tp_size*pp_size = 3*1*2 != world size 4",
        ),
    ],
)
def test_impossible_pipelines_are_refused(tmp_path, overrides, message):
    """One line each, before any rank starts."""
    base = ["launcher.nproc_per_node=2", "parallelism.pp_size=2"]
    with pytest.raises(ConfigError) as err:
        validate(
            compose_config(small_run_overrides(tmp_path, tmp_path, tmp_path, *base, *overrides))
        )
    assert message in one_line(err)


def test_microbatches_default_to_one_per_stage():
    assert ParallelismConfig(pp_size=4).microbatches == 4
    assert ParallelismConfig(pp_size=4, pp_microbatches=8).microbatches == 8


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule",
    ["interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"],
)
def test_multi_stage_schedules_match_single_process(
    tmp_path, reference, text_corpus, cache_dir, schedule
):
    """4 blocks as 4 stages, 2 per rank (looped: rank 0 runs stages 0 and 2; V-shaped: 0
    and 3, so its embedding and head stay one tied parameter), 4 micro-batches. The
    estimate per stage, from torch's order of each rank's actions, equals the run's.

    Losses and clipping norms hold 1e-5; weights 1e-4 absolute, not 1e-5: the pipeline sums
    4 micro-batches' weight gradients where one process multiplies the whole batch, and
    AdamW's division by sqrt(v) enlarges that last-bit difference where an element's
    gradient nearly cancels. Measured: under every one of these schedules the same one of
    the 16,384 elements of the last block's w2 is off by 2.2e-5 after 4 steps at lr <= 2e-3
    (the median element by 1.6e-9), so it is the micro-batch split, not the schedule."""
    extra = ("model.n_layers=4", "parallelism.pp_virtual_stages=2", "parallelism.pp_microbatches=4")
    summary, out = pp_run(tmp_path, text_corpus, cache_dir, "gpt2-tiny", schedule, *extra)
    assert_run_matches(reference("gpt2-tiny", extra[0]), out, STEPS, weight_atol=1e-4)
    assert_stage_estimates(summary, *pp_overrides("gpt2-tiny", schedule, *extra))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "extra"),
    [("gpt2-tiny", ()), ("llama-tiny", ("parallelism.sequence_parallel=true",))],
)
def test_pipeline_times_tensor_parallel(tmp_path, reference, text_corpus, cache_dir, model, extra):
    """pp=2 x tp=2 on 4 ranks: each stage's part split by tensor parallel (the tied
    embedding's two copies are vocab shards, summed shard by shard). The vocabulary is
    padded to 258 by tp; the reference pads the same way. The estimate per stage and tp
    rank equals what each rank measured."""
    extra = ("parallelism.tp_size=2", *extra)
    summary, out = pp_run(tmp_path, text_corpus, cache_dir, model, "1f1b", *extra, nproc=4)
    assert_run_matches(reference(model, "model.vocab_multiple=2"), out, STEPS)
    assert_stage_estimates(summary, *pp_overrides(model, "1f1b", *extra, nproc=4))


@pytest.mark.slow
def test_3d_fsdp_tensor_pipeline(tmp_path, reference, text_corpus, cache_dir):
    """dp=2 x tp=2 x pp=2 on 8 ranks: FSDP2 over the dp sub-mesh of each stage (each stage
    its own FSDP root), tensor parallel inside, each dp rank reading half the batch of 8."""
    extra = ("parallelism=fsdp", "parallelism.tp_size=2", "train.micro_batch_size=4")
    summary, out = pp_run(tmp_path, text_corpus, cache_dir, "gpt2-tiny", "1f1b", *extra, nproc=8)
    assert (summary["dp_size"], summary["tp_size"], summary["pp_size"]) == (2, 2, 2)
    assert_run_matches(reference("gpt2-tiny", "model.vocab_multiple=2"), out, STEPS)
    # FSDP2 computes with gathered copies of the parameters, which the matmuls save: the
    # estimate's gathered_weights (the root's, and the block the first backward gathers).
    assert_stage_estimates(summary, *pp_overrides("gpt2-tiny", "1f1b", *extra, nproc=8))


@pytest.mark.slow
def test_checkpoints_move_between_pipeline_and_one_process(
    tmp_path, reference, text_corpus, cache_dir
):
    """A pp=2 run (tied embedding split over the stages) saved at step 2 resumes in one
    process, and a one-process checkpoint resumes at pp=2: steps 3-4 equal the
    uninterrupted run either way. The head copy's optimizer state is saved under the
    embedding's name, as one process keys the shared parameter."""
    half = f"checkpoint.every={STEPS // 2}"
    _, pp_out = pp_run(tmp_path, text_corpus, cache_dir, "gpt2-tiny", "1f1b", half, name="pp")
    _, single_out = run(
        tmp_path,
        "single",
        text_corpus,
        cache_dir,
        "train.micro_batch_size=8",
        f"train.max_steps={STEPS}",
        half,
    )
    step = f"step_{STEPS // 2:06d}"
    _, resumed_single = run(
        tmp_path,
        "resumed_single",
        text_corpus,
        cache_dir,
        "train.micro_batch_size=8",
        f"train.max_steps={STEPS}",
        f"checkpoint.resume={pp_out / 'checkpoints' / step}",
    )
    _, resumed_pp = pp_run(
        tmp_path,
        text_corpus,
        cache_dir,
        "gpt2-tiny",
        "1f1b",
        f"checkpoint.resume={single_out / 'checkpoints' / step}",
        name="resumed_pp",
    )
    for out in (resumed_single, resumed_pp):
        assert_run_matches(reference("gpt2-tiny"), out, STEPS, first_step=STEPS // 2 + 1)


@pytest.mark.slow
def test_a_pipeline_run_resumes_from_its_own_checkpoint(
    tmp_path, reference, text_corpus, cache_dir
):
    """pp=2 saved at step 2 resumes at pp=2. Each stage's optimizer param_groups name only
    its own parameters, and DCP keeps one rank's copy of a non-tensor value, so each stage
    must take its own names back (it failed with KeyError: 'betas' before)."""
    half = f"checkpoint.every={STEPS // 2}"
    _, pp_out = pp_run(tmp_path, text_corpus, cache_dir, "gpt2-tiny", "1f1b", half, name="pp")
    step = f"step_{STEPS // 2:06d}"
    _, resumed = pp_run(
        tmp_path,
        text_corpus,
        cache_dir,
        "gpt2-tiny",
        "1f1b",
        f"checkpoint.resume={pp_out / 'checkpoints' / step}",
        name="resumed",
    )
    assert_run_matches(reference("gpt2-tiny"), resumed, STEPS, first_step=STEPS // 2 + 1)


@pytest.mark.slow
def test_pipeline_bf16_tracks_one_process_in_bf16(tmp_path, reference, text_corpus, cache_dir):
    """Under bf16 autocast the stages compute as one process does (the residual stream
    that crosses the stage boundary stays fp32), so only the order of gradient additions
    differs, which bf16 rounding magnifies: measured at most 2.9e-5 relative over these
    steps, so 1e-3 leaves room yet catches a wrong normalisation (the loss falls 9%)."""
    bf16 = "precision=bf16"
    summary, out = pp_run(tmp_path, text_corpus, cache_dir, "llama-tiny", "1f1b", bf16)
    ref, got = train_losses(reference("llama-tiny", bf16)), train_losses(out)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-3), step
    assert_stage_estimates(summary, *pp_overrides("llama-tiny", "1f1b", bf16))


@pytest.mark.slow
def test_pipeline_accumulates_loader_batches_under_recompute(
    tmp_path, reference, text_corpus, cache_dir
):
    """Two loader batches of 4 per step (two schedule steps, gradients accumulating) with
    every block checkpointed (recompute wraps the part's blocks before the stages are
    built): the same step as one batch of 8 in one process."""
    extra = ("train.micro_batch_size=4", "train.grad_accum_steps=2", "recompute=full")
    summary, out = pp_run(tmp_path, text_corpus, cache_dir, "gpt2-tiny", "1f1b", *extra)
    assert_run_matches(reference("gpt2-tiny"), out, STEPS)
    assert_stage_estimates(summary, *pp_overrides("gpt2-tiny", "1f1b", *extra))


@pytest.mark.slow
def test_frozen_parameters_under_pipeline(tmp_path, reference, text_corpus, cache_dir):
    """``model.freeze`` patterns name parameters of the whole model: layers.0 lives on stage
    0 only, and the tied head copy on stage 1 is frozen with the embedding, as the shared
    parameter is in one process."""
    frozen = "model.freeze=[tok_embeddings.*,layers.0.*]"
    _, out = pp_run(tmp_path, text_corpus, cache_dir, "gpt2-tiny", "1f1b", frozen)
    assert_run_matches(reference("gpt2-tiny", frozen), out, STEPS)


@pytest.mark.slow
def test_pp_split_names_the_stage_boundaries(tmp_path, reference, text_corpus, cache_dir):
    """pp_split=[3]: blocks 0-2 on stage 0, block 3 with the head on stage 1."""
    four = "model.n_layers=4"
    _, out = pp_run(
        tmp_path, text_corpus, cache_dir, "gpt2-tiny", "gpipe", four, "parallelism.pp_split=[3]"
    )
    assert_run_matches(reference("gpt2-tiny", four), out, STEPS)
