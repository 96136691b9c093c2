"""The estimator's moments of a replica's step (llm.estimate.single_moments) against the
peak tracker of the same configuration trained by train.py's path (in one process, as
benchmarks/gpu_pass/estimator.py ``measure`` runs it; ddp on 2 gloo ranks): fp32 on CPU,
the third step (the first tracked one with optimizer states), the estimate's total within
3% of the tracker's peak and its largest moment the phase the tracker names."""

from __future__ import annotations

import pytest
from helpers import compose_config, run, small_run_overrides

from llm.build import model_args_for
from llm.estimate.estimator import estimate, meta_model
from llm.optim import optimizer_param_groups

GOAL = 0.03
ACTIVATIONS_DOMINATE = {  # b=4, T=256: the saved activations are most of the peak
    "llama": ("model=llama-tiny", "model.d_model=128", "model.d_ff=512", "data.seq_len=256"),
    "gpt2": ("model=gpt2-tiny", "model.d_model=128", "data.seq_len=256"),
}
# b=1, T=32: model states are most of the peak; the for-loop AdamW's temporaries set it
STATES_DOMINATE = ("model=llama-tiny", "model.d_model=256", "model.d_ff=1024",
                   "data.seq_len=32", "train.micro_batch_size=1", "optimizer.fused=false")  # fmt: skip


def _measured_and_estimated(tmp_path, text_corpus, cache_dir, *extra):
    overrides = ("precision=fp32", "train.max_steps=3", "checkpoint.enabled=false", *extra)
    summary, out = run(tmp_path, "run", text_corpus, cache_dir, *overrides)
    cfg = compose_config(
        [*small_run_overrides(out, text_corpus, cache_dir, *overrides), "estimate.device=cpu"]
    )
    return summary["memory_peak"][0], estimate(cfg, model_args_for(cfg, vocab_size=257))


@pytest.mark.parametrize("recompute", ["none", "selective", "full", "op_sac"])
@pytest.mark.parametrize("family", sorted(ACTIVATIONS_DOMINATE))
def test_the_estimate_is_the_trackers_peak_where_activations_dominate(
    tmp_path, text_corpus, cache_dir, family, recompute
):
    """Without recompute the loss's backward (gpt2) or the last block's MLP backward (llama)
    sets the peak; under full recompute the first block's, where every later block's weight
    gradients exist. Each is a backward moment, as the tracker's."""
    extra = (*ACTIVATIONS_DOMINATE[family], f"recompute={recompute}")
    peak, est = _measured_and_estimated(tmp_path, text_corpus, cache_dir, *extra)
    assert est.total == pytest.approx(peak["total"], rel=GOAL), est.peak_rows
    assert est.peak_moment == peak["phase"] == "backward"
    assert est.peak_rows["params"] == peak["params"]


@pytest.mark.parametrize(("family", "moment"), [("gpt2", "forward"), ("llama", "backward")])
def test_the_chunked_loss_keeps_its_gradients_and_no_logits(
    tmp_path, text_corpus, cache_dir, family, moment
):
    """train.fused_loss=chunked: no head input or log-softmax is saved; the two gradients it
    computes in the forward are (to within a few bytes of the tracker's most activations).
    Its forward's working tensors (a chunk's logits beside logsumexp's copy of them) set
    gpt2's peak in the forward; llama's last MLP backward is larger."""
    extra = (*ACTIVATIONS_DOMINATE[family], "train.fused_loss=chunked")
    peak, est = _measured_and_estimated(tmp_path, text_corpus, cache_dir, *extra)
    outside = est.activations["outside_terms"]
    assert "loss.log_softmax" not in outside and "head.input" not in outside
    assert est.device["activations"] == pytest.approx(peak["activations_max"], abs=16)
    assert est.total == pytest.approx(peak["total"], rel=GOAL), est.peak_rows
    assert est.peak_moment == peak["phase"] == moment


def test_the_optimizer_step_is_the_peak_where_states_dominate(tmp_path, text_corpus, cache_dir):
    """torch's for-loop AdamW (optimizer.fused=false on CPU) holds a parameter's square
    root and quotient beside the previous parameter's: above the end of backward."""
    peak, est = _measured_and_estimated(tmp_path, text_corpus, cache_dir, *STATES_DOMINATE)
    assert est.total == pytest.approx(peak["total"], rel=GOAL), est.peak_rows
    assert est.peak_moment == peak["phase"] == "optimizer_step"
    assert est.optimizer_step["optimizer_temporaries"] > 0


def test_accumulated_gradients_exist_at_every_moment(tmp_path, text_corpus, cache_dir):
    """train.grad_accum_steps=2: every gradient exists from the second micro-batch on, at the
    end of forward and in backward too."""
    extra = (*ACTIVATIONS_DOMINATE["llama"], "recompute=full", "train.grad_accum_steps=2")
    peak, est = _measured_and_estimated(tmp_path, text_corpus, cache_dir, *extra)
    assert est.total == pytest.approx(peak["total"], rel=GOAL), est.peak_rows
    assert est.peak_moment == peak["phase"] == "backward"
    assert est.device["grads"] == est.backward["grads"] == est.optimizer_step["grads"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_ddp_replicas_hold_every_gradient_in_their_buckets(
    tmp_path, text_corpus, cache_dir, recompute
):
    """parallelism=ddp on 2 gloo ranks: DDP's gradient buckets persist from step to step
    (gradients are views of them), so every moment holds every gradient and a new one is
    copied in and freed, as under accumulation. The tracker counts a bucket once a gradient
    is copied into it, which at this llama shape is before the peak (the MLP's backward);
    at the loss's backward, the start of backward, it would miss them."""
    extra = (*ACTIVATIONS_DOMINATE["llama"], f"recompute={recompute}")
    extra += ("parallelism=ddp", "launcher.nproc_per_node=2")
    peak, est = _measured_and_estimated(tmp_path, text_corpus, cache_dir, *extra)
    assert est.total == pytest.approx(peak["total"], rel=GOAL), est.peak_rows
    assert est.peak_moment == peak["phase"] == "backward"
    assert est.backward["grads"] == peak["grads"] == est.device["grads"] > 0


def _cuda_estimate(*extra):
    base = ["logger=none", "output_dir=unused", "model=gpt2-tiny", "precision=bf16"]
    cfg = compose_config([*base, "estimate.device=cuda", *extra])
    args = model_args_for(cfg, vocab_size=cfg.data.vocab_size)
    model = meta_model(cfg, args.padded(cfg.model.vocab_multiple))
    return estimate(cfg, args), model, cfg


def test_foreach_adamw_adds_a_square_root_per_parameter_and_fused_adds_nothing():
    """optimizer.fused=false on CUDA is torch's foreach AdamW: one fp32 square root of
    exp_avg_sq per parameter of a param group at once, so about 4 bytes per parameter (the
    decayed group: all but norms and biases) at the optimizer step; the fused kernel none."""
    foreach, model, cfg = _cuda_estimate("optimizer.fused=false")
    fused, _, _ = _cuda_estimate()
    groups = optimizer_param_groups(model, cfg.optimizer)
    largest = max(sum(p.numel() for p in g["params"]) for g in groups)
    n = sum(p.numel() for p in model.parameters())
    assert foreach.optimizer_step["optimizer_temporaries"] == 4 * largest
    assert 4 * largest == pytest.approx(4 * n, rel=0.02)
    assert fused.optimizer_step["optimizer_temporaries"] == 0
    states = ("params", "grads", "optimizer_states", "cublas_workspaces")
    assert sum(fused.optimizer_step.values()) == sum(fused.optimizer_step[k] for k in states)
    assert {k: foreach.optimizer_step[k] for k in states} == {
        k: fused.optimizer_step[k] for k in states
    }


def test_the_json_names_each_moment_and_the_peak():
    """estimate.json keeps device_bytes (the end of forward) and adds the moments; the total
    is the largest moment's."""
    est, _, _ = _cuda_estimate("optimizer.fused=false")
    data = est.to_json()
    assert data["device_bytes"] == est.device and data["backward_bytes"] == est.backward
    assert data["optimizer_step_bytes"] == est.optimizer_step
    totals = {name: sum(rows.values()) for name, rows in est.moments.items()}
    assert data["total_bytes"] == max(totals.values()) == totals[data["peak_moment"]]
    assert est.device["grads"] == 0 and est.optimizer_step["grads"] > 0
