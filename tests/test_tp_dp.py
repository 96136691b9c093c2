"""Data parallel over the dp sub-mesh with tensor parallel (dp=2 x tp=2, 4 gloo ranks): our
ZeRO stages and ddp against one process, same seed and data (fp32; zero1/zero3 in bf16
too); their collectives per step on dp and tp; checkpoints resumed across layouts; and the
estimator's model-state bytes against what each rank holds.

As in test_tensor_parallel.py the tp runs pad the byte tokenizer's 257 tokens to 258 and
the reference pads the same way (model.vocab_multiple=2); each dp rank reads half the global batch
of 8. fp32 runs differ from one process only in the order partial sums are added (the
row-parallel outputs, the vocab-parallel softmax, the reduce-scatter over dp), hence the
shared tolerance of helpers.assert_run_matches: 1e-5 relative on losses and clipping
norms, 1e-4 relative + 1e-5 absolute on final weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import (
    assert_run_matches,
    compose_config,
    read_metrics,
    reference_runs,
    run,
    small_run_overrides,
)
from torch.distributed.tensor import DTensor

from llm.build import model_args_for
from llm.config import ParallelismConfig
from llm.estimate.estimator import estimate
from llm.launch.launcher import free_port
from llm.models import InitSource, build_model, materialize_from, model_args
from llm.parallel import ParallelDims, build_strategy
from llm.parallel.tensor_parallel import (
    apply_tensor_parallel,
    local_tensor,
    tp_local_shapes,
)
from llm.precision import resolve_precision

CPU = torch.device("cpu")

STEPS = 2
RESUME_AFTER = 1  # the step whose checkpoint other layouts resume from
PADDED_VOCAB = 258  # the byte tokenizer's 257, padded to a multiple of tp=2


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir):
    return reference_runs(tmp_path_factory, text_corpus, cache_dir, STEPS, "model.vocab_multiple=2")


def dp_tp_overrides(strategy: str, model: str, sequence_parallel: bool, accum: int) -> list[str]:
    """4 ranks as dp=2 x tp=2 under ``strategy``, small buckets (several per step, pieces
    cut mid-parameter), ``accum`` micro-batches per step (each dp rank's 4 sequences in all),
    checkpointed after step RESUME_AFTER too."""
    return [
        f"model={model}",
        f"parallelism={strategy}",
        "launcher.nproc_per_node=4",
        "parallelism.tp_size=2",
        f"parallelism.sequence_parallel={str(sequence_parallel).lower()}",
        "parallelism.bucket_cap_mb=0.05",
        f"train.micro_batch_size={4 // accum}",
        f"train.grad_accum_steps={accum}",
        f"train.max_steps={STEPS}",
        f"checkpoint.every={RESUME_AFTER}",
        "parallelism.count_comm=true",
    ]


@pytest.fixture(scope="module")
def dp_tp_on(tmp_path_factory, text_corpus, cache_dir):
    """dp=2 x tp=2 runs (``dp_tp_overrides``), once per module:
    ``dp_tp_on(strategy, model, sequence_parallel, accum) -> (summary, output directory)``."""
    runs = {}

    def get(strategy: str, model: str, sequence_parallel: bool, accum: int = 1):
        key = (strategy, model, sequence_parallel, accum)
        if key not in runs:
            tmp = tmp_path_factory.mktemp(f"{strategy}_{model}_{sequence_parallel}")
            overrides = dp_tp_overrides(*key)
            runs[key] = run(tmp, strategy, text_corpus, cache_dir, *overrides)
        return runs[key]

    return get


# (strategy, model, sequence_parallel, micro-batches per step). With 2 micro-batches zero1
# adds each DTensor gradient into its bucket twice before one reduce-scatter, and ddp skips
# the first all-reduce.
LAYOUTS = [
    ("zero1", "gpt2-tiny", False, 1),
    pytest.param("zero1", "llama-tiny", True, 2, marks=pytest.mark.slow),
    pytest.param("zero2", "llama-tiny", True, 1, marks=pytest.mark.slow),
    pytest.param("zero2", "gpt2-tiny", False, 1, marks=pytest.mark.slow),
    pytest.param("zero3", "gpt2-tiny", False, 1, marks=pytest.mark.slow),
    pytest.param("zero3", "llama-tiny", True, 1, marks=pytest.mark.slow),
    pytest.param("ddp", "gpt2-tiny", False, 1, marks=pytest.mark.slow),
    pytest.param("ddp", "llama-tiny", True, 2, marks=pytest.mark.slow),
]
LAYOUT_NAMES = ("strategy", "model", "sequence_parallel", "accum")


@pytest.mark.parametrize(LAYOUT_NAMES, LAYOUTS)
@pytest.mark.slow
def test_dp_over_tensor_parallel_matches_single_process(
    reference, dp_tp_on, strategy, model, sequence_parallel, accum
):
    """Our ZeRO shards each rank's tensor-parallel blocks over its dp group, ddp replicates
    them. gpt2-tiny: the tied embedding (one DTensor, two uses), biases, learned positions;
    llama-tiny: GQA, SwiGLU, and under sequence parallel Partial gradients of the norm
    gains."""
    summary, out = dp_tp_on(strategy, model, sequence_parallel, accum)
    assert summary["tp_size"] == 2 and summary["dp_size"] == 2
    assert summary["skipped_steps"] == 0
    assert_run_matches(reference(model), out, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "nproc"),
    [(("parallelism=single",), 2), (("parallelism=fsdp",), 4)],
    ids=["single_tp2", "fsdp_dp2_tp2"],
)
def test_zero_tp_checkpoint_resumes_in_other_layouts(
    tmp_path, reference, dp_tp_on, text_corpus, cache_dir, layout, nproc
):
    """DCP holds the zero3 (dp=2 x tp=2, sequence parallel) run's pieces at their places in
    the whole parameters: tensor parallel alone (2 ranks, DTensor shards) and FSDP2 over
    dp=2 x tp=2 read them, and the next step continues the uninterrupted run. The resumed
    runs' held bytes check the estimator for these two layouts too."""
    _, saved = dp_tp_on("zero3", "llama-tiny", True)
    checkpoint = saved / "checkpoints" / f"step_{RESUME_AFTER:06d}"
    overrides = [
        "model=llama-tiny",
        *layout,
        f"launcher.nproc_per_node={nproc}",
        "parallelism.tp_size=2",
        "parallelism.sequence_parallel=true",
        f"train.micro_batch_size={8 * 2 // nproc}",
        f"train.max_steps={STEPS}",
        f"checkpoint.resume={checkpoint}",
    ]
    summary, out = run(tmp_path, "resumed", text_corpus, cache_dir, *overrides)
    assert summary["tp_size"] == 2
    assert_run_matches(reference("llama-tiny"), out, STEPS, first_step=RESUME_AFTER + 1)
    assert_estimate_matches(tmp_path, text_corpus, cache_dir, overrides, summary, nproc)


@pytest.mark.slow
def test_tp_checkpoint_resumes_under_zero(tmp_path, reference, text_corpus, cache_dir):
    """The other way: tensor parallel alone (2 ranks, sequence parallel) writes DTensor
    shards after step 1; zero1 over dp=2 x tp=2 reads into its pieces the chunks that
    overlap them, and step 2 continues the uninterrupted run."""
    tp_alone = [
        "model=llama-tiny",
        "launcher.nproc_per_node=2",
        "parallelism.tp_size=2",
        "parallelism.sequence_parallel=true",
        "train.micro_batch_size=8",
        f"train.max_steps={STEPS}",
        f"train.stop_at_step={RESUME_AFTER}",  # the schedule still spans STEPS
        f"checkpoint.every={RESUME_AFTER}",
    ]
    _, saved = run(tmp_path, "tp_alone", text_corpus, cache_dir, *tp_alone)
    checkpoint = saved / "checkpoints" / f"step_{RESUME_AFTER:06d}"
    overrides = dp_tp_overrides("zero1", "llama-tiny", True, 1)
    _, out = run(
        tmp_path, "zero1", text_corpus, cache_dir, *overrides, f"checkpoint.resume={checkpoint}"
    )
    assert_run_matches(reference("llama-tiny"), out, STEPS, first_step=RESUME_AFTER + 1)


def assert_estimate_matches(tmp_path, text_corpus, cache_dir, overrides, summary, nproc):
    """llm.estimate's model states (a plain meta model, tensor parallel's split read off its
    plan, the strategy's sharding over dp) equal strategy.memory() after a step on every
    rank, byte for byte."""
    cfg = compose_config(
        [*small_run_overrides(tmp_path, text_corpus, cache_dir, *overrides), "estimate.device=cpu"]
    )
    args = model_args_for(cfg, vocab_size=PADDED_VOCAB)
    measured = summary["model_state_bytes"]
    assert len(measured) == nproc
    for rank, held in enumerate(measured):
        cfg.estimate.rank = rank
        predicted = estimate(cfg, args).device
        assert {k: predicted[k] for k in held} == held, f"rank {rank}"


@pytest.mark.parametrize(LAYOUT_NAMES, LAYOUTS)
@pytest.mark.slow
def test_estimate_equals_what_each_rank_holds(
    tmp_path, dp_tp_on, text_corpus, cache_dir, strategy, model, sequence_parallel, accum
):
    """The estimator against every rank of each dp=2 x tp=2 run (our ZeRO's buckets of the
    local blocks, ddp's replicas of them)."""
    summary, _ = dp_tp_on(strategy, model, sequence_parallel, accum)
    overrides = dp_tp_overrides(strategy, model, sequence_parallel, accum)
    assert_estimate_matches(tmp_path, text_corpus, cache_dir, overrides, summary, 4)


def _local_params(model: str) -> tuple[int, int, int]:
    """Parameters one tp rank holds (tensor parallel's split of the padded model): all,
    those outside the blocks, and those of the norms."""
    meta = build_model(model_args(model, vocab_size=PADDED_VOCAB))
    shapes = tp_local_shapes(meta, 2, 0)
    blocks = {p for p in meta.layers.parameters()}
    norms = {p for n, p in meta.named_parameters() if "norm" in n}
    total = sum(s.numel() for s in shapes.values())
    root = sum(s.numel() for p, s in shapes.items() if p not in blocks)
    return total, root, sum(shapes[p].numel() for p in norms)


@pytest.mark.parametrize(LAYOUT_NAMES, LAYOUTS)
def test_collectives_per_step_on_dp_and_tp(dp_tp_on, strategy, model, sequence_parallel, accum):
    """Payload bytes per rank and step (fp32): on the dp group, 2 x Φ_local for zero1/2
    (reduce-scatter of gradients, all-gather of parameters), 3 x Φ_local less the root for
    zero3 (its blocks gathered in forward and again in backward), one all-reduce of Φ_local
    for ddp; Φ_local = the parameters of one tp rank, padding of each bucket to a multiple
    of dp aside. On tp, Megatron's per layer for the dp rank's b=4 sequences (as
    test_tensor_parallel.py counts them), plus under sequence parallel one all-reduce of
    each norm gain's Partial gradient, which our ZeRO's gradient hook (every micro-batch)
    and FSDP2's replicate (the micro-batch that syncs) resolve inside backward."""
    summary, _ = dp_tp_on(strategy, model, sequence_parallel, accum)
    args = model_args(model)
    phi, root, norms = (4 * n for n in _local_params(model))
    b, s = 4, 64  # sequences per dp rank and step (all micro-batches), data.seq_len
    activations = (4 * args.n_layers + 2) * b * s * args.d_model * 4
    loss = 3 * b * s * 4
    # Our ZeRO's hook resolves them on every micro-batch; replicate once, at the sync.
    per_step = accum if strategy.startswith("zero") else 1
    gains = per_step * norms if sequence_parallel else 0
    expected_tp = (
        {"tp.all_gather": activations, "tp.reduce_scatter": activations, "tp.all_reduce": loss}
        if sequence_parallel
        else {"tp.all_reduce": activations + loss}
    )
    expected_dp = {
        "zero1": {"reduce_scatter": phi, "all_gather": phi},
        "zero2": {"reduce_scatter": phi, "all_gather": phi},
        "zero3": {"reduce_scatter": phi, "all_gather": 2 * phi - root},
        "ddp": {"all_reduce": phi},
    }[strategy]
    slack = 64 * 4  # padding: fewer than dp elements per bucket, fp32
    for rank in summary["comm_bytes_per_step"]:
        tp = {k: v for k, v in rank.items() if k.startswith("tp.")}
        dp = {k: v for k, v in rank.items() if not k.startswith("tp.")}
        assert tp.keys() == expected_tp.keys() and dp.keys() == expected_dp.keys(), rank
        for kind, value in expected_tp.items():
            assert tp[kind] == value + (gains if kind == "tp.all_reduce" else 0), kind
        for kind, value in expected_dp.items():
            assert dp[kind] == pytest.approx(value, abs=slack), kind


def _wrap_materialised_tp_model(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        dims = ParallelDims.from_config(-1, 2, 1, world, rank)  # dp=1 x tp=2
        args = model_args("llama-tiny", vocab_size=PADDED_VOCAB)
        model = apply_tensor_parallel(build_model(args), dims.tp_mesh(), sequence_parallel=False)
        materialize_from(model, InitSource(args, seed=0), CPU)
        tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
        before = {n: local_tensor(p).clone() for n, p in model.named_parameters()}
        split = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
        with torch.no_grad():
            logits = model(tokens).to_local()
        strategy = build_strategy(
            ParallelismConfig(name="zero1", tp_size=2, bucket_cap_mb=0.05),
            dims,
            resolve_precision("fp32", CPU),
            CPU,
        )
        strategy.wrap(model)  # no weight source: the blocks are taken as they are
        after = {n: p for n, p in model.named_parameters()}
        buckets = {id(s.param): b for b in strategy.buffers for s in b.bucket.slots}
        results[rank] = {
            "same_values": all(torch.equal(local_tensor(after[n]), v) for n, v in before.items()),
            "dtensors": {n for n, p in after.items() if isinstance(p, DTensor)} == split != set(),
            "views_of_buckets": all(
                local_tensor(p).untyped_storage().data_ptr()
                == buckets[id(p)].full.untyped_storage().data_ptr()
                for p in after.values()
            ),
            "same_logits": torch.equal(model(tokens).detach().to_local(), logits),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_zero_takes_a_materialised_tensor_parallel_model():
    """``wrap(model)`` without a weight source reads each DTensor's local block
    (ModuleSource), and leaves every split parameter a DTensor (the norms stay plain), each
    a view of its bucket: the values and the forward are unchanged (2 ranks, dp=1 x tp=2)."""
    results = mp.Manager().dict()
    mp.start_processes(
        _wrap_materialised_tp_model,
        args=(2, free_port(), results),
        nprocs=2,
        start_method="spawn",
    )
    for rank in range(2):
        assert results[rank] == dict.fromkeys(
            ("same_values", "dtensors", "views_of_buckets", "same_logits"), True
        ), rank


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory, text_corpus, cache_dir):
    """One bf16 process: ``({step: loss}, {step: clipping norm})``."""
    tmp = tmp_path_factory.mktemp("tp_dp_bf16_reference")
    _, out = run(
        tmp,
        "single",
        text_corpus,
        cache_dir,
        "model=llama-tiny",
        "model.vocab_multiple=2",
        "precision=bf16",
        "train.micro_batch_size=8",
        f"train.max_steps={STEPS}",
    )
    metrics = [m for m in read_metrics(out) if "loss" in m]
    return {m["step"]: m["loss"] for m in metrics}, {m["step"]: m["grad_norm"] for m in metrics}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_zero_tp_bf16_tracks_one_bf16_process(
    tmp_path, text_corpus, cache_dir, bf16_reference, strategy
):
    """precision=bf16 (bf16 working blocks, fp32 masters and reductions) against one bf16
    process, with test_bf16_parity.py's tolerances and reasons (u/2 = 2^-9 on losses, one
    bf16 ulp 2^-7 on clipping norms: the runs differ in where bf16 rounding happens); the
    estimator's bytes, with the masters apart from the working blocks, on every rank."""
    overrides = [*dp_tp_overrides(strategy, "llama-tiny", True, 1), "precision=bf16"]
    summary, out = run(tmp_path, strategy, text_corpus, cache_dir, *overrides)
    ref_losses, ref_norms = bf16_reference
    got = {m["step"]: m for m in read_metrics(out) if "loss" in m}
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, m in got.items():
        assert m["loss"] == pytest.approx(ref_losses[step], rel=2**-9), step
        assert m["grad_norm"] == pytest.approx(ref_norms[step], rel=2**-7), step
    assert_estimate_matches(tmp_path, text_corpus, cache_dir, overrides, summary, 4)
