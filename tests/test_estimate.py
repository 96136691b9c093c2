"""The estimator (python -m llm.estimate): model states equal to what strategies hold,
the ZeRO paper's worked example, DeepSpeed's own estimators beside ours, the published
shapes' vocabularies, and the plan."""

from __future__ import annotations

import json

import pytest
from helpers import compose_config, run, small_run_overrides

from llm.build import model_args_for, tokenizer_vocab_size
from llm.estimate.estimator import estimate
from llm.estimate.plan import plan
from llm.estimate.report import human
from llm.estimate.startup import announce_estimate
from llm.models import model_args, num_params

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
    """Ours for parallelism=deepspeed is the ZeRO paper's arithmetic (mixed-precision Adam,
    K = 12): 2Φ + 14Φ/N at stage 2, 16Φ/N at stage 3. DeepSpeed 0.19.8's
    estimate_zero{2,3}_model_states_mem_needs (no offload) count 2Φ + 18Φ/N and
    4·L + 18Φ/N: an fp32 gradient partition more (+4Φ/N; +2Φ/N at stage 3) and a 4-byte
    buffer of the largest layer L. At 8 GPUs ours is 0.88x theirs at stage 2. The figure
    llm.estimate prints beside ours (llm.estimate.deepspeed_own) is DeepSpeed's own, and its
    transcription (used where deepspeed does not import) equals it."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from llm.estimate.deepspeed_own import _transcribed, deepspeed_own

    phi, largest = 1_000_000_000, 50_000_000
    common = ["parallelism=deepspeed", "precision=bf16", f"estimate.gpus_per_node={n_gpus}"]
    ours2 = _estimate(*common, "parallelism.zero_stage=2", f"estimate.num_params={phi}")
    assert ours2.total == pytest.approx(2 * phi + 14 * phi / n_gpus, abs=n_gpus)
    _, ds2 = estimate_zero2_model_states_mem_needs(phi, n_gpus, 1, cpu_offload=False)
    assert ds2 == pytest.approx(ours2.total + 4 * phi / n_gpus, abs=n_gpus)
    ours3 = _estimate(*common, "parallelism.zero_stage=3", f"estimate.num_params={phi}")
    assert ours3.total == pytest.approx(16 * phi / n_gpus, abs=n_gpus)
    _, ds3, _ = estimate_zero3_model_states_mem_needs(phi, largest, n_gpus, 1, cpu_offload=False)
    assert ds3 == pytest.approx(ours3.total + 2 * phi / n_gpus + 4 * largest, abs=n_gpus)
    if n_gpus == 8:
        assert ours2.total / ds2 == pytest.approx(0.88, abs=0.005)
    own2, own3 = deepspeed_own(2, phi, largest, n_gpus), deepspeed_own(3, phi, largest, n_gpus)
    assert own2.source.startswith("deepspeed ")
    assert (own2.bytes_per_gpu, own3.bytes_per_gpu) == (ds2, ds3)
    assert deepspeed_own(1, phi, largest, n_gpus) is None
    for opt, par in [(False, False), (True, False), (True, True)]:
        _, ds2 = estimate_zero2_model_states_mem_needs(phi, n_gpus, 2, cpu_offload=opt)
        assert _transcribed(2, phi, largest, n_gpus, 2, opt, par) == ds2
        ds3 = estimate_zero3_model_states_mem_needs(
            phi, largest, n_gpus, 2, cpu_offload=opt, cpu_offload_params=par
        )[1]
        assert _transcribed(3, phi, largest, n_gpus, 2, opt, par) == ds3


@pytest.mark.slow
def test_estimate_prints_deepspeeds_own_beside_ours(tmp_path):
    """python -m llm.estimate parallelism=deepspeed at stage 2: both figures, and the JSON."""
    out = tmp_path / "est.json"
    proc = _cli(
        tmp_path,
        "model=gpt2-tiny",
        "parallelism=deepspeed",
        "parallelism.zero_stage=2",
        "precision=bf16",
        "estimate.gpus_per_node=8",
        f"estimate.json={out}",
    )
    own = json.loads(out.read_text())["deepspeed_own"]
    assert own["ours_bytes_per_gpu"] < own["bytes_per_gpu"]
    assert "2Φ + 18Φ/N" in proc.stdout and "ours is 0.8" in proc.stdout


def _cli(tmp_path, *overrides):
    import subprocess
    import sys

    return subprocess.run(
        [
            sys.executable,
            "-m",
            "llm.estimate",
            "logger=none",
            f"hydra.run.dir={tmp_path}/h",
            *overrides,
        ],
        check=True,
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize(
    ("model", "vocab", "billions"),
    [("bloom-176b", 250880, (176.2, 176.3)), ("llama2-7b", 32000, (6.735, 6.745))],
)
def test_published_models_keep_their_vocabulary(model, vocab, billions):
    """A published shape's config names its vocabulary (conf/model/*.yaml vocab_size), so
    the estimator and the run size it, not the data tokenizer's 4,096 ids (which gave BLOOM
    172.7B parameters and llama2-7b 6.51B); the title says which vocabulary and count."""
    from llm.estimate.__main__ import _title, model_summary

    cfg = compose_config(["logger=none", "output_dir=unused", f"model={model}"])
    assert tokenizer_vocab_size(cfg) == 4096
    args = model_args_for(cfg, vocab_size=tokenizer_vocab_size(cfg))
    assert args.vocab_size == vocab
    summary = model_summary(cfg, args)
    assert billions[0] <= summary["n_params"] / 1e9 <= billions[1]
    assert summary["n_params"] == num_params(args)
    title = _title(cfg, summary)
    assert f"vocabulary {vocab:,} (model.vocab_size)" in title
    assert f"{summary['n_params'] / 1e9:.2f}B parameters" in title


def test_every_published_config_names_the_registered_vocabulary():
    """The vocab_size a conf/model/*.yaml sets is the registry's for that shape; the shapes
    tests and benchmarks train on small tokenizers set none and follow the tokenizer."""
    from pathlib import Path

    from llm.models import MODEL_SHAPES

    named = {}
    for path in sorted((Path(__file__).parents[1] / "conf" / "model").glob("*.yaml")):
        cfg = compose_config(["logger=none", "output_dir=unused", f"model={path.stem}"])
        if cfg.model.vocab_size is not None:
            named[path.stem] = cfg.model.vocab_size
            assert cfg.model.vocab_size == MODEL_SHAPES[path.stem].vocab_size, path.stem
    assert set(named) == {
        "bloom-176b",
        "gpt3-175b",
        "megatron-1t",
        "llama2-7b",
        "llama3-8b",
        "gpt2-xl",
        "dialogpt-large",
        "mixtral-8x7b",
        "deepseek-moe-16b",
    }


@pytest.mark.slow
def test_cli_title_names_vocabulary_and_parameters(tmp_path):
    """python -m llm.estimate model=bloom-176b: 176.28B parameters, vocabulary 250,880."""
    out = tmp_path / "est.json"
    proc = _cli(tmp_path, "model=bloom-176b", f"estimate.json={out}")
    words = proc.stdout.split()
    assert "176.28B" in words and "250,880" in words, proc.stdout[:400]
    model = json.loads(out.read_text())["model"]
    assert model["vocab_size"] == 250880 and model["vocab_source"] == "model.vocab_size"
    assert 176.2e9 <= model["n_params"] <= 176.3e9


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused():
    """model.vocab_size below the tokenizer's (known from the config for byte and bpe) is
    refused in one line before any data is prepared, as the run refuses it once built."""
    from llm.errors import ConfigError
    from llm.validate import check_vocab

    cfg = compose_config(
        ["logger=none", "output_dir=unused", "model=llama2-7b", "data.vocab_size=40000"]
    )
    with pytest.raises(ConfigError, match="vocab_size=32000 is smaller than the tokenizer's 40000"):
        check_vocab(cfg, model_args_for(cfg, vocab_size=tokenizer_vocab_size(cfg)))
    unset = compose_config(["logger=none", "output_dir=unused", "data.vocab_size=8192"])
    check_vocab(unset, model_args_for(unset, vocab_size=tokenizer_vocab_size(unset)))


def _states_match(tmp_path, text_corpus, cache_dir, strategy, model, precision, *extra):
    overrides = [
        f"parallelism={strategy}",
        "launcher.nproc_per_node=2",
        f"model={model}",
        f"precision={precision}",
        "train.max_steps=2",
        "checkpoint.enabled=false",
        *extra,
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


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
@pytest.mark.parametrize("optimizer", ["adafactor", "muon", "adamw8bit"])
def test_sharded_whole_matrix_and_8bit_states_equal_measured(
    tmp_path, text_corpus, cache_dir, strategy, optimizer
):
    """The estimate reads the whole parameter where the optimizer does: Adafactor's whole row
    and column vectors per holder, 8-bit AdamW's size rule, and our ZeRO's 256-element
    alignment under 8-bit AdamW (a vocabulary of 320 rows: FSDP cuts 257 inside a block)."""
    extra = (f"optimizer={optimizer}", "optimizer.min_8bit_size=1024", "model.vocab_size=320")
    _states_match(tmp_path, text_corpus, cache_dir, strategy, "llama-tiny", "fp32", *extra)


def test_llama3_8b_plan_on_eight_80gb_devices():
    """docs/recompute.md's plan, sized as python -m llm.estimate sizes it (the tokenizer's
    vocabulary where the model names none): llama3-8b's config names 128,256, so the figures
    are those the registry gave this test before 2026-11-26, when the command used 4,096."""
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
    args = model_args_for(cfg, vocab_size=tokenizer_vocab_size(cfg))
    assert args.vocab_size == 128256
    rows = plan(cfg, args)
    fitting = [r for r in rows if r.fits]
    assert fitting and all(r.bytes_per_gpu <= 80 * 2**30 for r in fitting)
    # Layouts that fit only by offloading their ZeRO states come after all the others.
    offloaded = [i for i, r in enumerate(fitting) if r.offload != "none"]
    assert offloaded == list(range(len(fitting) - len(offloaded), len(fitting)))
    fitting = [r for r in fitting if r.offload == "none"]
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
    moments = [data["device_bytes"], data["backward_bytes"]]  # zero2: a backward moment
    assert data["world"] == 4 and data["total_bytes"] == max(sum(m.values()) for m in moments)
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


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallelism.tp_size=2"], r"world size 1 is not divisible by tp_size\*pp_size=2"),
        (
            ["model=gpt2-xl", "parallelism.tp_size=2", "estimate.gpus_per_node=2"],
            "model.n_heads=25 is not divisible by parallelism.tp_size=2",
        ),
    ],
)
def test_a_layout_the_run_would_refuse_is_refused_in_one_line(overrides, message):
    """A world smaller than tp x pp, or a tp that splits no head evenly, crashed the
    estimator with ZeroDivisionError; it is refused as the run refuses it."""
    from llm.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _estimate(*overrides)
