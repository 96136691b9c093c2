"""moe-tiny trained with expert parallelism (parallelism.ep_size) under ddp, our ZeRO and
FSDP2 against one process: same seed, data and global batch of 8 sequences, fp32, dropless routing. Losses
and clipping norms within 1e-5 relative, final weights (read back through DCP, whole) within
1e-4 (helpers.assert_run_matches): the experts compute the same rows in another order.
Checkpoints move between ep sizes and to one process through DCP (expert slices saved as
DTensors on the (edp, ep) mesh)."""

from __future__ import annotations

import pytest
from helpers import CONF, assert_run_matches, read_metrics, reference_runs, run

STEPS = 3
MOE = ("model.moe.z_loss_coef=0.001",)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir):
    return reference_runs(tmp_path_factory, text_corpus, cache_dir, STEPS, *MOE)


def _ep_run(tmp_path, text_corpus, cache_dir, name, ranks, ep, *extra, strategy="ddp"):
    return run(
        tmp_path, name, text_corpus, cache_dir, "model=moe-tiny", *MOE,
        f"parallelism={strategy}", f"parallelism.ep_size={ep}",
        f"launcher.nproc_per_node={ranks}", f"train.micro_batch_size={8 // ranks}",
        f"train.max_steps={STEPS}", *extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    "strategy",
    [
        "zero2",
        *(pytest.param(s, marks=pytest.mark.slow) for s in ("ddp", "fsdp", "zero1", "zero3")),
    ],
)
def test_ep2_on_two_ranks_equals_one_process(tmp_path, text_corpus, cache_dir, reference, strategy):
    """The README's command (zero2): the experts split over both ranks (edp = 1), the rest
    under the strategy; the all-to-all bytes are counted every step."""
    summary, out = _ep_run(
        tmp_path, text_corpus, cache_dir, "ep2", 2, 2, "parallelism.count_comm=true",
        strategy=strategy,
    )  # fmt: skip
    assert summary["ep_size"] == 2
    assert_run_matches(reference("moe-tiny"), out, STEPS)
    assert all(c["all_to_all"] > 0 for c in summary["comm_bytes_per_step"])
    if strategy == "ddp":
        # Each rank holds half of every layer's experts: the per-rank parameter bytes drop
        # by half of the experts' (2 layers x 3 x 8 x 96 x 64 fp32 values).
        experts = 2 * 3 * 8 * 96 * 64 * 4
        ep1_params = 4 * summary["n_params"]
        assert all(s["params"] == ep1_params - experts // 2 for s in summary["model_state_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
@pytest.mark.parametrize("ep", [2, 4])
def test_four_ranks_equal_one_process(tmp_path, text_corpus, cache_dir, reference, ep, strategy):
    """ep 2 on 4 ranks: two replicas of each expert slice, reduced over their edp pair."""
    _, out = _ep_run(tmp_path, text_corpus, cache_dir, f"ep{ep}", 4, ep, strategy=strategy)
    assert_run_matches(reference("moe-tiny"), out, STEPS)


@pytest.mark.slow
def test_checkpoints_move_from_ep2_to_one_process_and_back(
    tmp_path, text_corpus, cache_dir, reference
):
    """Saved at ep 2 under zero2 after step 1; one process resumes it whole, and ep 2 under
    fsdp resumes one process's step-2 checkpoint; every resumed step is the uninterrupted
    run's."""
    ref = reference("moe-tiny")
    _, ep2 = _ep_run(
        tmp_path, text_corpus, cache_dir, "ep2", 2, 2, "train.stop_at_step=1",
        "checkpoint.every=1", strategy="zero2",
    )  # fmt: skip
    _, single = run(
        tmp_path, "single", text_corpus, cache_dir, "model=moe-tiny", *MOE,
        "train.micro_batch_size=8", f"train.max_steps={STEPS}", "checkpoint.every=1",
        f"checkpoint.resume={ep2 / 'checkpoints' / 'step_000001'}",
    )  # fmt: skip
    assert_run_matches(ref, single, STEPS, first_step=2)
    _, back = _ep_run(
        tmp_path, text_corpus, cache_dir, "ep2_again", 2, 2,
        f"checkpoint.resume={single / 'checkpoints' / 'step_000002'}", strategy="fsdp",
    )  # fmt: skip
    assert_run_matches(ref, back, STEPS, first_step=3)
    assert [m["step"] for m in read_metrics(back) if "loss" in m] == [3]


@pytest.mark.slow
def test_checkpoints_move_from_ep4_to_ep2(tmp_path, text_corpus, cache_dir, reference):
    ref = reference("moe-tiny")
    _, ep4 = _ep_run(
        tmp_path, text_corpus, cache_dir, "ep4", 4, 4, "train.stop_at_step=1", "checkpoint.every=1"
    )
    _, ep2 = _ep_run(
        tmp_path, text_corpus, cache_dir, "ep2", 2, 2,
        f"checkpoint.resume={ep4 / 'checkpoints' / 'step_000001'}", strategy="zero2",
    )  # fmt: skip
    assert_run_matches(ref, ep2, STEPS, first_step=2)


EP_LAYOUTS = sorted(p.stem for p in (CONF / "layout").glob("*_ep*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", EP_LAYOUTS)
def test_every_ep_layout_equals_one_process(tmp_path, text_corpus, cache_dir, reference, layout):
    """conf/layout's expert-parallel layouts (4 ranks, each naming model=moe-tiny, which
    the test's own model=gpt2-tiny would override on the command line: named again)."""
    summary, out = run(
        tmp_path, layout, text_corpus, cache_dir, f"layout={layout}", "model=moe-tiny", *MOE,
        "train.micro_batch_size=2", f"train.max_steps={STEPS}",
    )  # fmt: skip
    assert summary["model"] == "moe-tiny" and summary["ep_size"] > 1
    assert_run_matches(reference("moe-tiny"), out, STEPS)


@pytest.mark.parametrize(
    "strategy", ["zero2", *(pytest.param(s, marks=pytest.mark.slow) for s in ("ddp", "fsdp"))]
)
@pytest.mark.slow
def test_estimate_equals_the_measured_states_on_every_ep_rank(
    tmp_path, text_corpus, cache_dir, strategy
):
    """python -m llm.estimate's model states (params, grads, optimizer states) equal what
    each ep rank holds after a step, exactly: the strategy's share of the dense part plus
    this rank's E / ep experts whole."""
    from helpers import compose_config, small_run_overrides

    from llm.build import model_args_for
    from llm.estimate.estimator import estimate

    overrides = ("model=moe-tiny", f"parallelism={strategy}", "parallelism.ep_size=2",
                 "launcher.nproc_per_node=2", "train.max_steps=2", "checkpoint.enabled=false")  # fmt: skip
    summary, _ = run(tmp_path, strategy, text_corpus, cache_dir, *overrides)
    cfg = compose_config(
        [
            *small_run_overrides(tmp_path / strategy, text_corpus, cache_dir, *overrides),
            "estimate.device=cpu",
        ]
    )
    args = model_args_for(cfg, vocab_size=257)
    for rank, measured in enumerate(summary["model_state_bytes"]):
        cfg.estimate.rank = rank
        est = estimate(cfg, args)
        assert {k: est.device[k] for k in measured} == measured, f"rank {rank}"


def test_the_plan_tries_expert_parallel_sizes_for_moe_shapes():
    """estimate.plan=true: a MoE shape gets rows at every ep dividing the devices and the
    experts, each with the keys estimate.json lists, the all-to-all bytes of even routing,
    fewer bytes per GPU for the whole expert slices as ep grows (stage 0), the same at stages
    1-3, which shard them over edp; a dense shape gets ep 1."""
    from helpers import compose_config

    from llm.build import model_args_for
    from llm.estimate.layout import expert_params
    from llm.estimate.plan import plan, plan_row

    base = ["logger=none", "output_dir=unused", "estimate.gpus_per_node=4", "data.seq_len=256"]
    cfg = compose_config([*base, "model=moe-tiny"])
    args = model_args_for(cfg, vocab_size=4096)
    rows = [plan_row(r) for r in plan(cfg, args)]
    keys = {"dp", "tp", "pp", "ep", "zero_stage", "recompute", "microbatches", "bytes_per_gpu",
            "fits", "step_time_s", "bubble", "a2a_bytes"}  # fmt: skip
    assert all(keys <= row.keys() for row in rows)
    assert {row["ep"] for row in rows} == {1, 2, 4}
    for row in rows:
        moe_blocks, k, d = 2, 2, 64
        leaving = row["micro_batch"] * 256 * k * (row["ep"] - 1) // row["ep"]
        # bf16 activations: precision=auto on the planner's default device (cuda).
        assert row["a2a_bytes"] == moe_blocks * row["microbatches"] * 4 * leaving * d * 2
    same = {
        r["ep"]: r["bytes_per_gpu"]
        for r in rows
        if (r["zero_stage"], r["recompute"], r["micro_batch"]) == (0, "none", 4)
    }
    assert same[4] < same[2] < same[1]
    # At stages 1-3 (our zero1-3, fsdp) each slice's sharded states are cut over its edp
    # ranks: 1/(ep x edp) = 1/dp of the experts at every ep, as the same stage at ep 1
    # holds them. What the stage keeps whole, the slice keeps whole: a rank saves those
    # bytes of the experts not its own (bf16 params, and at stage 1 grads; to the byte
    # counts' rounding). Whole slices would save their sharded states' bytes too.
    experts = expert_params(args)
    for stage, whole_bytes in ((1, 4), (2, 2), (3, 0)):
        sharded = {
            r["ep"]: r["bytes_per_gpu"]
            for r in rows
            if (r["zero_stage"], r["recompute"], r["micro_batch"]) == (stage, "none", 4)
        }
        for ep in (2, 4):
            saved = whole_bytes * experts * (ep - 1) // ep
            assert sharded[1] - sharded[ep] == pytest.approx(saved, abs=8), (stage, ep)
    dense = compose_config([*base, "model=llama-tiny"])
    assert {r.layout.ep for r in plan(dense, model_args_for(dense, vocab_size=4096))} == {1}


@pytest.mark.slow
def test_a_capacity_drops_the_same_tokens_as_one_process_under_ep(
    tmp_path, text_corpus, cache_dir, reference
):
    """zero2 at ep 2 with a capacity below the load: the global first-come rule keeps the
    same assignments as one process, so the runs match and some were dropped."""
    capacity = "model.moe.capacity_factor=0.75"
    _, out = _ep_run(tmp_path, text_corpus, cache_dir, "cap", 2, 2, capacity, strategy="zero2")
    ref = reference("moe-tiny", capacity)
    assert_run_matches(ref, out, STEPS)
    assert min(m["moe/dropped_share"] for m in read_metrics(out) if "moe/dropped_share" in m) > 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero1", "zero2", "zero3"])
def test_the_expert_slices_are_sharded_over_edp(
    tmp_path, text_corpus, cache_dir, reference, strategy
):
    """ep 2 on 4 ranks (edp 2) equals one process. Each rank holds 1/edp of its expert slice
    (params, grads and AdamW's moments): measured equals the estimate on every rank; under
    fsdp the model states are those of ep 1, where FSDP shards every expert over all 4
    ranks; under our ZeRO the ranks' AdamW moments add up to the model's once (a slice
    whole on each edp rank would count the experts twice). One process resumes the step-1
    checkpoint exactly; under zero3 so does ep 2 on 2 ranks (edp 1)."""
    from helpers import compose_config, small_run_overrides

    from llm.build import model_args_for
    from llm.estimate.estimator import estimate

    ref = reference("moe-tiny")
    summary, out = _ep_run(
        tmp_path, text_corpus, cache_dir, "edp2", 4, 2, "checkpoint.every=1",
        "checkpoint.keep_last=3", strategy=strategy,
    )  # fmt: skip
    assert_run_matches(ref, out, STEPS)
    overrides = (
        "model=moe-tiny", f"parallelism={strategy}", "launcher.nproc_per_node=4",
        "train.micro_batch_size=2",
    )  # fmt: skip
    base = [*small_run_overrides(tmp_path / "est", text_corpus, cache_dir, *overrides)]
    cfg = compose_config([*base, "parallelism.ep_size=2", "estimate.device=cpu"])
    ep1 = compose_config([*base, "parallelism.ep_size=1", "estimate.device=cpu"])
    args = model_args_for(cfg, vocab_size=257)
    for rank, measured in enumerate(summary["model_state_bytes"]):
        cfg.estimate.rank = ep1.estimate.rank = rank
        assert {k: estimate(cfg, args).device[k] for k in measured} == measured, f"rank {rank}"
        if strategy == "fsdp":
            assert {k: estimate(ep1, args).device[k] for k in measured} == measured, f"rank {rank}"
    if strategy != "fsdp":
        # fp32 AdamW: the master is the shard itself, so a rank's optimizer states are its
        # pieces' two moments (8 bytes an element) and one 4-byte step count per piece.
        moments = sum(s["optimizer_states"] for s in summary["model_state_bytes"])
        assert 0 <= moments - 8 * summary["n_params"] < 4096
    step1 = out / "checkpoints" / "step_000001"
    _, single = run(
        tmp_path, "single", text_corpus, cache_dir, "model=moe-tiny", *MOE,
        "train.micro_batch_size=8", f"train.max_steps={STEPS}", f"checkpoint.resume={step1}",
    )  # fmt: skip
    assert_run_matches(ref, single, STEPS, first_step=2)
    if strategy == "zero3":
        _, edp1 = _ep_run(
            tmp_path, text_corpus, cache_dir, "edp1", 2, 2, f"checkpoint.resume={step1}",
            strategy=strategy,
        )  # fmt: skip
        assert_run_matches(ref, edp1, STEPS, first_step=2)
