"""The estimator (python -m llm.estimate): model states equal to what strategies hold,
the ZeRO paper's worked example, DeepSpeed's own estimators, and the plan."""

from __future__ import annotations

import json

import pytest
from helpers import compose_config, run, small_run_overrides

from llm.estimate.estimator import estimate
from llm.estimate.plan import plan
from llm.estimate.report import human
from llm.estimate.startup import announce_estimate
from llm.models import model_args, num_params
from llm.validate import model_args_for, tokenizer_vocab_size

GB = 1e9


def _estimate(*overrides):
    cfg = compose_config(["logger=none", "output_dir=unused", *overrides])
    return estimate(cfg, model_args_for(cfg, vocab_size=cfg.data.vocab_size))


@pytest.mark.parametrize("stage,expected_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_worked_example(stage, expected_gb):
    """Rajbhandari et al. 2020, figure 1: Φ = 7.5B, N = 64, K = 12 (mixed-precision Adam)."""
    est = _estimate(
        "parallelism=deepspeed",
        f"parallelism.zero_stage={stage}",
        "precision=bf16",
        "estimate.num_params=7.5e9",
        "estimate.gpus_per_node=64",
    )
    assert est.total / GB == pytest.approx(expected_gb, rel=0.01)


@pytest.mark.parametrize("n_gpus", [8, 64])
def test_deepspeed_own_estimators(n_gpus):
    """DeepSpeed's estimate_zero{2,3}_model_states_mem_needs (no offload, mixed-precision
    Adam) equal our paper figures plus the terms DeepSpeed adds: ZeRO-2 keeps an fp32
    gradient partition beside the paper's 16-bit one (+4Φ/N); ZeRO-3 also that (+2Φ/N of
    16-bit gradient partition over the paper's... counted: 18Φ/N against 16Φ/N) and a
    4-byte buffer of the largest layer."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    phi, largest = 1_000_000_000, 50_000_000
    common = ["parallelism=deepspeed", "precision=bf16", f"estimate.gpus_per_node={n_gpus}"]
    ours2 = _estimate(*common, "parallelism.zero_stage=2", f"estimate.num_params={phi}")
    _, ds2 = estimate_zero2_model_states_mem_needs(phi, n_gpus, 1, cpu_offload=False)
    assert ds2 == pytest.approx(ours2.total + 4 * phi / n_gpus, abs=n_gpus)
    ours3 = _estimate(*common, "parallelism.zero_stage=3", f"estimate.num_params={phi}")
    _, ds3, _ = estimate_zero3_model_states_mem_needs(phi, largest, n_gpus, 1, cpu_offload=False)
    assert ds3 == pytest.approx(ours3.total + 2 * phi / n_gpus + 4 * largest, abs=n_gpus)


def _states_match(tmp_path, text_corpus, cache_dir, strategy, model, precision):
    overrides = [
        f"parallelism={strategy}",
        "launcher.nproc_per_node=2",
        f"model={model}",
        f"precision={precision}",
        "train.max_steps=2",
        "checkpoint.enabled=false",
    ]
    summary, _ = run(tmp_path, strategy, text_corpus, cache_dir, *overrides)
    # The run's own config (micro-batch, sequence length, byte tokenizer), as train.py sees it.
    cfg = compose_config(
        [
            *small_run_overrides(tmp_path / strategy, text_corpus, cache_dir, *overrides),
            "estimate.device=cpu",
        ]
    )
    args = model_args_for(cfg, vocab_size=257)  # the byte tokenizer's vocabulary
    for rank, measured in enumerate(summary["model_state_bytes"]):
        cfg.estimate.rank = rank
        est = estimate(cfg, args)
        predicted = {k: est.device[k] for k in measured}
        assert predicted == measured, f"rank {rank}"
        if rank == 0:  # the Trainer's count (saved-tensor hooks, parameters left out), rank 0's
            acts = summary["activation_bytes"]
            assert est.device["activations"] == pytest.approx(acts, rel=0.03), acts


def test_model_states_equal_zero3(tmp_path, text_corpus, cache_dir):
    """Exact equality with what the strategy holds after a step (strategy.memory(): the
    tensors state_tensors() names, which the peak tracker classifies by)."""
    _states_match(tmp_path, text_corpus, cache_dir, "zero3", "gpt2-tiny", "bf16")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_model_states_equal_measured(tmp_path, text_corpus, cache_dir, strategy, model):
    precision = "bf16" if strategy.startswith("zero") else "fp32"
    _states_match(tmp_path, text_corpus, cache_dir, strategy, model, precision)


def test_llama3_8b_plan_on_eight_80gb_devices():
    cfg = compose_config(
        [
            "logger=none",
            "output_dir=unused",
            "model=llama3-8b",
            "data.seq_len=8192",
            "estimate.gpus_per_node=8",
            "estimate.device_memory_gb=80",
        ]
    )
    rows = plan(cfg, model_args_for(cfg))
    fitting = [r for r in rows if r.fits]
    assert fitting and all(r.bytes_per_gpu <= 80 * 2**30 for r in fitting)
    assert [r.step_time_s for r in fitting] == sorted(r.step_time_s for r in fitting)
    # A replica cannot hold 8B parameters with Adam (16 B/param = 128 GB): plain data
    # parallel (ZeRO stage 0) fits only with tensor or pipeline parallel beside it.
    replicas = [r for r in rows if r.layout.tp * r.layout.pp == 1 and r.layout.zero_stage == 0]
    assert replicas and not any(r.fits for r in replicas)
    # Compute-bound once communication overlaps: parameter sharding over all 8 devices with
    # no recompute and no tensor-parallel all-reduces on the critical path comes first.
    first = fitting[0].layout
    assert (first.dp, first.zero_stage, first.recompute) == (8, 3, "none")
    # Full recompute costs a third more compute: never ahead of selective at equal layout.
    rank = {
        (
            r.layout.dp,
            r.layout.tp,
            r.layout.pp,
            r.layout.zero_stage,
            r.layout.micro_batch,
            r.layout.recompute,
        ): i
        for i, r in enumerate(fitting)
    }
    for key, i in rank.items():
        if key[-1] == "full" and (*key[:-1], "selective") in rank:
            assert rank[(*key[:-1], "selective")] < i


def test_cli_writes_json(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "est.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "llm.estimate",
            "model=gpt2-tiny",
            "logger=none",
            "parallelism=zero2",
            "launcher.nproc_per_node=4",
            "estimate.plan=true",
            f"estimate.json={out}",
            f"hydra.run.dir={tmp_path}/h",
        ],
        check=True,
        capture_output=True,
    )
    data = json.loads(out.read_text())
    assert data["world"] == 4 and data["total_bytes"] == sum(data["device_bytes"].values())
    assert data["activations"]["n_layers"] == 2
    keys = {"dp", "tp", "pp", "zero_stage", "recompute", "microbatches"}
    keys |= {"bytes_per_gpu", "fits", "step_time_s", "bubble"}
    rows = data["plan"]
    assert rows and all(keys <= set(r) for r in rows)
    assert all(r["dp"] * r["tp"] * r["pp"] == 4 for r in rows)
    fitting = [r["step_time_s"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting) and rows[0]["fits"]


@pytest.mark.parametrize(
    ("overrides", "blocks_held"),
    [
        (["parallelism=ddp", "parallelism.pp_size=2"], "all"),  # replicate: nothing resharded
        (["parallelism=fsdp", "parallelism.reshard_after_forward=false"], "all"),
        (["parallelism=fsdp"], "last"),  # re-gathered by the first backward
        (["parallelism=ddp"], "none"),  # torch's DDP computes with the parameters themselves
    ],
)
def test_gathered_weights_are_the_weights_autograd_saves(overrides, blocks_held):
    """gpt2-tiny, fp32, one sequence of 64 tokens: a block's linear weights (12·d²) and
    LayerNorm gains and biases (4·d); the root's final LayerNorm (2·d) and the tied head
    (V·d), whose lookup as an embedding saves nothing. Resharded blocks: the last one,
    gathered by the first backward after the head's saved tensors and the root's gathered
    weights are freed (here it outweighs the root before backward)."""
    nproc = 4 if "parallelism.pp_size=2" in overrides else 2
    cfg = compose_config(
        [
            "output_dir=unused",
            "logger=none",
            "model=gpt2-tiny",
            "data.seq_len=64",
            "train.micro_batch_size=1",
            f"launcher.nproc_per_node={nproc}",
            "estimate.device=cpu",
            *overrides,
        ]
    )
    args = model_args_for(cfg, vocab_size=257)
    d, v = args.d_model, 257
    block, root = 4 * (12 * d * d + 4 * d), 4 * (2 * d + v * d)
    est = estimate(cfg, args)
    if blocks_held == "none":
        assert "gathered_weights" not in est.device
    elif blocks_held == "all" and est.stages:  # stage 0: its block; stage 1: block, norm, head
        assert [s.device["gathered_weights"] for s in est.stages] == [block, block + root]
    elif blocks_held == "all":
        assert est.device["gathered_weights"] == root + args.n_layers * block
    else:
        terms = est.activations["outside_terms"]
        head = sum(n for k, n in terms.items() if not k.startswith(("embed.", "pos_embed.")))
        assert 0 < head < block and block - head > root
        assert est.device["gathered_weights"] == block - head


def test_estimate_sizes_the_tokenizers_vocabulary(capsys):
    """python -m llm.estimate and train.py's start-up estimate take the byte tokenizer's 257
    ids, not data.vocab_size (the size a BPE would be trained to)."""
    byte = ["output_dir=unused", "logger=none", "model=gpt2-tiny", "data.tokenizer=byte"]
    cfg = compose_config(byte)
    assert cfg.data.vocab_size != 257 and tokenizer_vocab_size(cfg) == 257
    announce_estimate(cfg, 1)
    params = 4 * num_params(model_args("gpt2-tiny", vocab_size=257))
    assert f"params {human(params)}" in capsys.readouterr().out
