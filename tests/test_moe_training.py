"""moe-tiny trained through train.py's path: the auxiliary losses reach the gradient, the
load is logged, and 2 data-parallel ranks under ddp, zero2 and fsdp equal one process
(helpers.assert_run_matches: losses and clipping norms within 1e-5, weights 1e-4; the logged
balance and z losses within 1e-5, since they are the whole batch's, not rank 0's), with
dropless routing, with a capacity that drops tokens, with the sigmoid router's bias, and
with transformers' pooled balance loss."""

from __future__ import annotations

import pytest
from helpers import assert_run_matches, read_metrics, reference_runs, run, train_losses

STEPS = 4
MOE = ("model.moe.z_loss_coef=0.001",)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir):
    return reference_runs(tmp_path_factory, text_corpus, cache_dir, STEPS, *MOE)


def _assert_moe_losses_match(ref_out, out) -> None:
    """The logged balance and z losses of every step equal one process's within 1e-5."""
    names = ("moe/balance_loss", "moe/z_loss")
    ref = {m["step"]: [m[n] for n in names] for m in read_metrics(ref_out) if names[0] in m}
    got = {m["step"]: [m[n] for n in names] for m in read_metrics(out) if names[0] in m}
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():
        assert values == pytest.approx(ref[step], abs=1e-5), step


def _ranks(tmp_path, text_corpus, cache_dir, strategy, *extra):
    return run(
        tmp_path,
        strategy,
        text_corpus,
        cache_dir,
        "model=moe-tiny",
        *MOE,
        f"parallelism={strategy}",
        "launcher.nproc_per_node=2",
        "train.micro_batch_size=4",
        f"train.max_steps={STEPS}",
        *extra,
    )


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(s, marks=pytest.mark.slow) if s != "zero2" else s
        for s in ("ddp", "zero2", "fsdp")
    ],
)
@pytest.mark.slow
def test_two_data_parallel_ranks_equal_one_process(
    tmp_path, text_corpus, cache_dir, reference, strategy
):
    summary, out = _ranks(tmp_path, text_corpus, cache_dir, strategy)
    assert_run_matches(reference("moe-tiny"), out, STEPS)
    _assert_moe_losses_match(reference("moe-tiny"), out)
    assert summary["n_active_params"] < summary["n_params"]


@pytest.mark.parametrize(
    "extra",
    [
        ("model.moe.capacity_factor=0.75",),
        ("model.moe.router=sigmoid", "model.moe.bias_update_rate=0.01"),
        ("model.moe.balance_loss=pooled", "model.moe.aux_loss_coef=0.1"),
    ],
    ids=["capacity", "sigmoid", "pooled"],
)
@pytest.mark.slow
def test_routing_variants_equal_one_process_under_zero2(
    tmp_path, text_corpus, cache_dir, reference, extra
):
    _, out = _ranks(tmp_path, text_corpus, cache_dir, "zero2", *extra)
    ref = reference("moe-tiny", *extra)
    assert_run_matches(ref, out, STEPS)
    _assert_moe_losses_match(ref, out)
    dropped = [m["moe/dropped_share"] for m in read_metrics(ref) if "moe/dropped_share" in m]
    assert (min(dropped) > 0) == ("capacity" in extra[0])


def test_aux_losses_reach_the_gradient_and_the_load_is_logged(
    tmp_path, text_corpus, cache_dir, reference
):
    """A large balance weight changes training; every logged step carries each layer's
    load, whose sum is tokens x top_k."""
    _, out = run(
        tmp_path, "heavy", text_corpus, cache_dir, "model=moe-tiny", *MOE,
        "train.micro_batch_size=8", f"train.max_steps={STEPS}", "model.moe.aux_loss_coef=10",
    )  # fmt: skip
    light = train_losses(reference("moe-tiny"))
    heavy = train_losses(out)
    assert heavy[1] == pytest.approx(light[1], rel=1e-6)  # the same first forward
    assert heavy[STEPS] != pytest.approx(light[STEPS], rel=1e-4)
    for m in read_metrics(out):
        if "loss" not in m:
            continue
        loads = m["moe/load"]
        assert sorted(loads) == ["layer0", "layer1"]
        assert all(sum(layer.values()) == 8 * 64 * 2 for layer in loads.values())
        assert m["moe/balance_loss"] > 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("model=llama-tiny", "parallelism.ep_size=2"), "splits experts, but model llama"),
        (
            ("model=moe-tiny", "parallelism.ep_size=3"),
            "ep_size=3 does not divide model.moe.n_experts=8",
        ),
        (("model=moe-tiny", "parallelism.ep_size=4"), "ep_size=4 does not divide the 2 ranks"),
        (("model=moe-tiny", "parallelism.tp_size=2"), "tensor and pipeline parallel do not split"),
        (
            ("model=moe-tiny", "parallelism=deepspeed", "parallelism.ep_size=2"),
            "DeepSpeed-MoE is not a backend",
        ),
        (
            ("model=moe-tiny", "parallelism=zero2", "parallelism.ep_size=2", "optimizer=adafactor"),
            "optimizer=adafactor with ep_size=2: expert slices step as whole local tensors",
        ),
        (
            (
                "model=moe-tiny",
                "parallelism=zero2",
                "parallelism.ep_size=2",
                "parallelism.offload_optimizer=true",
            ),
            "offload_optimizer=cpu with ep_size=2",
        ),
        (
            ("model=llama-tiny", "model.moe.top_k=2"),
            "model.moe.top_k is set but model llama-tiny is dense",
        ),
        (("model=moe-tiny", "model.moe.top_k=9"), "top_k=9 exceeds model.moe.n_experts=8"),
    ],
)
def test_bad_expert_settings_are_refused_in_one_line_before_any_rank(tmp_path, extra, message):
    from helpers import compose_config, one_line, small_run_overrides

    from llm.errors import ConfigError
    from llm.validate import validate

    cfg = compose_config(
        small_run_overrides(
            tmp_path, tmp_path, tmp_path, "parallelism=ddp", "launcher.nproc_per_node=2", *extra
        )
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert message in one_line(err)


@pytest.mark.parametrize("policy", ["full", pytest.param("selective", marks=pytest.mark.slow)])
def test_recompute_reruns_the_moe_forward_without_changing_the_run(
    tmp_path, text_corpus, cache_dir, reference, policy
):
    """The recomputed forward routes the same tokens and its loads are not counted twice."""
    _, out = run(
        tmp_path, policy, text_corpus, cache_dir, "model=moe-tiny", *MOE,
        "train.micro_batch_size=8", f"train.max_steps={STEPS}", f"recompute={policy}",
    )  # fmt: skip
    ref = reference("moe-tiny")
    assert train_losses(out) == pytest.approx(train_losses(ref), rel=1e-6)
    loads = {m["step"]: m["moe/load"] for m in read_metrics(out) if "moe/load" in m}
    assert loads == {m["step"]: m["moe/load"] for m in read_metrics(ref) if "moe/load" in m}


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("model.moe.z_loss_coef=0.001", "model.moe.router=sigmoid", "model.moe.n_shared_experts=1"),
        ("model.moe.aux_loss_coef=0", "model.moe.norm_topk=false"),
        pytest.param(("model.moe.balance_loss=pooled",), marks=pytest.mark.slow),
    ],
    ids=["default", "sigmoid_shared_z", "no_balance_unnormalised", "pooled"],
)
def test_estimate_counts_the_activated_experts_activations_exactly(
    tmp_path, text_corpus, cache_dir, extra
):
    """python -m llm.estimate's activations (top_k rows per token through the experts,
    whatever the routing) equal what the Trainer's saved-tensor count finds, exactly, on
    CPU in fp32; the peak tracker's most live activations are within 3% of it (its peak
    also holds the loss's temporaries)."""
    from helpers import compose_config, small_run_overrides

    from llm.build import model_args_for
    from llm.estimate.estimator import estimate

    overrides = ("model=moe-tiny", "precision=fp32", "train.max_steps=2",
                 "checkpoint.enabled=false", *extra)  # fmt: skip
    summary, _ = run(tmp_path, "moe", text_corpus, cache_dir, *overrides)
    cfg = compose_config(
        [
            *small_run_overrides(tmp_path / "moe", text_corpus, cache_dir, *overrides),
            "estimate.device=cpu",
        ]
    )
    est = estimate(cfg, model_args_for(cfg, vocab_size=257))
    assert est.device["activations"] == summary["activation_bytes"]
    most = summary["memory_peak"][0]["activations_max"]
    assert est.device["activations"] == pytest.approx(most, rel=0.03)
