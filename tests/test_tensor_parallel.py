"""Tensor (and sequence) parallelism on gloo against one process, fp32, same seed and data.

Every run has the reference's global batch of 8 sequences. The tp runs use the byte
tokenizer's 257 tokens, which tensor parallel pads to 258 (the padded id's logit -inf); the
reference pads the same way (model.vocab_multiple=2), so both start from the same weights
and shapes. In fp32
the runs differ only in how partial sums are added (row-parallel outputs, vocab-parallel
softmax), hence 1e-5 relative on losses and gradient norms, 1e-4 on weights.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    assert_run_matches,
    compose_config,
    one_line,
    reference_runs,
    run,
    small_run_overrides,
    train_losses,
)

from llm.build import model_args_for
from llm.errors import ConfigError
from llm.estimate.estimator import estimate
from llm.models import model_args
from llm.parallel.step import global_grad_norm
from llm.validate import validate

STEPS = 4
PADDED_VOCAB = 258  # the byte tokenizer's 257, padded to a multiple of tp=2


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir):
    return reference_runs(tmp_path_factory, text_corpus, cache_dir, STEPS, "model.vocab_multiple=2")


def tp_run(tmp_path, name, text_corpus, cache_dir, model, *extra):
    return run(
        tmp_path,
        name,
        text_corpus,
        cache_dir,
        f"model={model}",
        "launcher.nproc_per_node=2",
        "parallelism.tp_size=2",
        "train.micro_batch_size=8",
        f"train.max_steps={STEPS}",
        *extra,
    )


@pytest.fixture(scope="module")
def tp_on(tmp_path_factory, text_corpus, cache_dir):
    """tp=2 runs, once per module, checkpointed half-way too:
    ``tp_on(model, sequence_parallel) -> (summary, output directory)``."""
    runs = {}

    def get(model: str, sequence_parallel: bool):
        key = (model, sequence_parallel)
        if key not in runs:
            tmp = tmp_path_factory.mktemp(f"tp_{model}_{sequence_parallel}")
            runs[key] = tp_run(
                tmp,
                "tp",
                text_corpus,
                cache_dir,
                model,
                f"parallelism.sequence_parallel={str(sequence_parallel).lower()}",
                f"checkpoint.every={STEPS // 2}",
                "parallelism.count_comm=true",
            )
        return runs[key]

    return get


def assert_matches(ref_out, out, first_step=1):
    # The clipping norm counts replicated parameters (norms, biases of row-parallel
    # layers, GPT-2's position table) once: the single process's norm (clipping is on).
    assert_run_matches(ref_out, out, STEPS, first_step)


@pytest.mark.parametrize(
    ("model", "sequence_parallel"),
    [
        ("gpt2-tiny", False),
        ("llama-tiny", True),
        pytest.param("llama-tiny", False, marks=pytest.mark.slow),
        pytest.param("gpt2-tiny", True, marks=pytest.mark.slow),
    ],
)
def test_tensor_parallel_matches_single_process(reference, tp_on, model, sequence_parallel):
    """gpt2-tiny: tied embedding, biases, learned positions; llama-tiny: GQA with kv heads
    split 2 -> 1 per rank, SwiGLU, untied head. The tp run pads the vocabulary itself."""
    summary, out = tp_on(model, sequence_parallel)
    assert summary["tp_size"] == 2 and summary["dp_size"] == 1
    assert_matches(reference(model), out)


@pytest.mark.parametrize(
    ("model", "sequence_parallel"), [("gpt2-tiny", False), ("llama-tiny", True)]
)
def test_tp_collectives_are_megatrons(tp_on, model, sequence_parallel):
    """Per step (one micro-batch of b x s tokens, fp32), on the tp dimension of the mesh:
    Megatron's 4 all-reduces of b*s*h per layer (2 forward after the row-parallel layers,
    2 backward before the column-parallel ones), or under SP 4 all-gathers + 4
    reduce-scatters of the same size; plus the vocab-parallel embedding (forward) and the
    LM head's input (backward), and loss_parallel's 3 all-reduces of b*s floats (max,
    sum of exponentials, target logit)."""
    summary, _ = tp_on(model, sequence_parallel)
    args = model_args(model)
    b, s = 8, 64  # train.micro_batch_size, data.seq_len
    bsh = b * s * args.d_model * 4
    activations = (4 * args.n_layers + 2) * bsh
    loss = 3 * b * s * 4
    expected = (
        {"tp.all_gather": activations, "tp.reduce_scatter": activations, "tp.all_reduce": loss}
        if sequence_parallel
        else {"tp.all_reduce": activations + loss}
    )
    assert summary["comm_bytes_per_step"] == [expected, expected]


@pytest.mark.slow
def test_replicated_kv_heads_match_single_process(tmp_path, reference, text_corpus, cache_dir):
    """Multi-query llama-tiny (1 kv head, 4 query heads) at tp=2, sequence parallel: tp
    cannot split one kv head, so wk and wv are replicated, each rank attends with its 2 query
    heads to the one kv head and the kv weights' gradients are summed over tp. The
    estimator's model states (the whole wk and wv on both ranks) equal what each rank holds."""
    mqa = "model.n_kv_heads=1"
    shape = (mqa, "parallelism.sequence_parallel=true")
    summary, out = tp_run(tmp_path, "tp_mqa", text_corpus, cache_dir, "llama-tiny", *shape)
    assert_matches(reference("llama-tiny", mqa), out)
    cfg = compose_config(
        [
            *small_run_overrides(
                tmp_path,
                text_corpus,
                cache_dir,
                "model=llama-tiny",
                *shape,
                "parallelism.tp_size=2",
            ),
            "launcher.nproc_per_node=2",
            "estimate.device=cpu",
        ]
    )
    args = model_args_for(cfg, vocab_size=PADDED_VOCAB)
    for rank, held in enumerate(summary["model_state_bytes"]):
        cfg.estimate.rank = rank
        predicted = estimate(cfg, args).device
        assert {k: predicted[k] for k in held} == held, f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero1", "ddp"])
def test_replicated_kv_heads_under_data_parallel(
    tmp_path, reference, text_corpus, cache_dir, strategy
):
    """dp=2 x tp=2, multi-query: the replicated wk/wv gradients (partial sums on tp) reach
    FSDP2, our ZeRO and replicate summed over tp, then averaged over dp."""
    mqa = "model.n_kv_heads=1"
    summary, out = run(
        tmp_path,
        strategy,
        text_corpus,
        cache_dir,
        "model=llama-tiny",
        mqa,
        f"parallelism={strategy}",
        "launcher.nproc_per_node=4",
        "parallelism.tp_size=2",
        "train.micro_batch_size=4",
        f"train.max_steps={STEPS}",
    )
    assert summary["tp_size"] == 2 and summary["dp_size"] == 2
    assert_matches(reference("llama-tiny", mqa), out)


@pytest.mark.slow
def test_two_kv_heads_replicated_over_four_tp_ranks(tmp_path, text_corpus, cache_dir):
    """llama-tiny's 2 kv heads at tp=4: ranks 0-1 keep kv head 0, ranks 2-3 kv head 1, one
    query head each; the vocabulary is padded to 260, given to one process too."""
    common = ("model=llama-tiny", "model.vocab_size=260", f"train.max_steps={STEPS}")
    _, ref_out = run(
        tmp_path, "single", text_corpus, cache_dir, *common, "train.micro_batch_size=8"
    )
    summary, out = run(
        tmp_path,
        "tp4",
        text_corpus,
        cache_dir,
        *common,
        "launcher.nproc_per_node=4",
        "parallelism.tp_size=4",
        "train.micro_batch_size=8",
    )
    assert summary["tp_size"] == 4
    assert_matches(ref_out, out)


def test_tp_checkpoint_resumes_in_one_process(tmp_path, reference, tp_on, text_corpus, cache_dir):
    """DCP writes the DTensor shards of the tp=2 (sequence parallel) run; one process reads
    them whole and steps 3-4 continue the uninterrupted run. The single process pads its
    vocabulary as tp=2 did (model.vocab_multiple=2), so both have one shape."""
    _, saved = tp_on("llama-tiny", True)
    checkpoint = saved / "checkpoints" / f"step_{STEPS // 2:06d}"
    summary, out = run(
        tmp_path,
        "resumed",
        text_corpus,
        cache_dir,
        "model=llama-tiny",
        "model.vocab_multiple=2",
        "train.micro_batch_size=8",
        f"train.max_steps={STEPS}",
        f"checkpoint.resume={checkpoint}",
    )
    assert summary["world_size"] == 1
    assert_matches(reference("llama-tiny"), out, first_step=STEPS // 2 + 1)


def test_grad_norm_divides_each_gradient_by_its_own_replicas():
    """A split weight counts once, a tp-replicated gain once per tp copy: sum of squares
    over the ranks divided per gradient, the whole model's norm."""
    split, gain = torch.full((4,), 3.0), torch.full((2,), 4.0)
    norm = global_grad_norm([split, gain], torch.device("cpu"), grad_replicas=[1, 2])
    assert norm.item() == pytest.approx(math.sqrt(4 * 9 + 2 * 16 / 2))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "sequence_parallel"), [("llama-tiny", True), ("gpt2-tiny", False)]
)
def test_fsdp_over_dp_times_tensor_parallel(
    tmp_path, reference, text_corpus, cache_dir, model, sequence_parallel
):
    """4 ranks as dp=2 x tp=2 (torchtitan's 2-D): FSDP2 shards the tp shards over the dp
    sub-mesh (strided dim-0 shards where both split rows), each dp rank reads half the
    global batch of 8."""
    summary, out = run(
        tmp_path,
        "fsdp_tp",
        text_corpus,
        cache_dir,
        f"model={model}",
        "parallelism=fsdp",
        "launcher.nproc_per_node=4",
        "parallelism.tp_size=2",
        f"parallelism.sequence_parallel={str(sequence_parallel).lower()}",
        "train.micro_batch_size=4",
        f"train.max_steps={STEPS}",
    )
    assert summary["tp_size"] == 2 and summary["dp_size"] == 2
    assert_matches(reference(model), out)


@pytest.mark.slow
def test_tensor_parallel_bf16_tracks_one_process_in_bf16(tmp_path, text_corpus, cache_dir):
    """Under bf16 autocast the row-parallel partial sums are rounded to bf16 before they
    are added, so tp differs from one process by bf16 rounding, not only by fp32 summation
    order: measured at most 1.4e-5 relative over these steps, so 1e-3 leaves room yet
    catches a wrong split (the loss falls by 9% over these steps)."""
    bf16 = ("precision=bf16", "model.vocab_multiple=2")
    _, ref_out = run(
        tmp_path,
        "single",
        text_corpus,
        cache_dir,
        "model=llama-tiny",
        "train.micro_batch_size=8",
        f"train.max_steps={STEPS}",
        *bf16,
    )
    _, out = tp_run(
        tmp_path,
        "tp",
        text_corpus,
        cache_dir,
        "llama-tiny",
        "parallelism.sequence_parallel=true",
        *bf16,
    )
    ref, got = train_losses(ref_out), train_losses(out)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-3), step


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.n_heads=2", "parallelism.tp_size=4"], "model.n_heads=2 is not divisible"),
        (
            [
                "model=llama-tiny",
                "model.d_model=96",
                "model.n_heads=6",
                "model.n_kv_heads=3",
                "parallelism.tp_size=2",
            ],
            "model.n_kv_heads=3 and parallelism.tp_size=2: key/value heads are split when",
        ),
        (["model.d_ff=250", "parallelism.tp_size=4"], "model.d_ff=250 is not divisible"),
        (
            ["parallelism.tp_size=2", "parallelism.sequence_parallel=true", "data.seq_len=63"],
            "data.seq_len=63 is not divisible by parallelism.tp_size=2",
        ),
        (["parallelism.sequence_parallel=true"], "sequence_parallel=true shards over"),
        (
            ["parallelism.tp_size=2", "parallelism.dp_size=3"],
            "dp_size*tp_size*pp_size = 3*2*1 != world size 4",
        ),
        (["parallelism=deepspeed", "parallelism.tp_size=2"], "parallelism=deepspeed with tp_size"),
        (["parallelism.tp_size=2", "optimizer=muon"], "optimizer=muon with parallelism.tp_size=2"),
        (["parallelism.tp_size=2", "optimizer=lamb"], "optimizer=lamb with parallelism.tp_size=2"),
        (["parallelism.tp_size=2", "optimizer=sophia"], "extra gradient pass samples"),
        (["parallelism.tp_size=2", "train.compile=true"], "train.compile=true with parallelism"),
    ],
)
def test_impossible_tensor_parallel_setups_are_refused(tmp_path, overrides, message):
    """One line each, before any rank starts (4 ranks asked for, none started)."""
    if not any(o.startswith("parallelism=") for o in overrides):
        overrides = ["parallelism=fsdp", *overrides]
    with pytest.raises(ConfigError) as err:
        validate(
            compose_config(
                small_run_overrides(
                    tmp_path, tmp_path, tmp_path, "launcher.nproc_per_node=4", *overrides
                )
            )
        )
    assert message in one_line(err)
