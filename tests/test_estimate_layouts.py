"""The estimator beyond this machine: per-rank parameters under tensor and pipeline
parallel, the pipeline schedules' in-flight micro-batches and bubble, the time model's
links, and the plan for published large runs (meta-free closed forms, no ranks)."""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config

from llm.build import model_args_for, tokenizer_vocab_size
from llm.errors import ConfigError
from llm.estimate.activations import layer_terms, outside_terms
from llm.estimate.cluster import Cluster
from llm.estimate.estimator import estimate
from llm.estimate.layout import (
    Layout,
    bubble,
    in_flight,
    p2p_bytes,
    rank_blocks,
    rank_params,
)
from llm.estimate.layout_estimate import Workload, estimate_layout
from llm.estimate.plan import plan
from llm.estimate.startup import announce_estimate
from llm.memory.storage import local_shard
from llm.models import build_model, model_args, num_params
from llm.parallel.tensor_parallel import apply_tensor_parallel
from llm.precision import resolve_precision

GIB = 2**30


def _cfg(*overrides):
    return compose_config(["logger=none", "output_dir=unused", *overrides])


@pytest.mark.parametrize("family", ["gpt2-tiny", "llama-tiny"])
def test_rank_params_without_parallelism_is_the_whole_model(family):
    args = model_args(family)
    assert rank_params(args, Layout(dp=1), 0) == num_params(args)


@pytest.mark.parametrize(
    ("family", "shape"),
    [("gpt2-tiny", {}), ("llama-tiny", {}), ("llama-tiny", {"n_kv_heads": 1})],
    ids=["gpt2", "llama", "llama-mqa"],
)
def test_rank_params_equal_a_tensor_parallel_ranks_shards(fake_tp_mesh, family, shape):
    """A tp=2 rank of the real split (DTensor on the fake process group) holds exactly the
    formula's parameters: split matrices and column biases halved, the rest whole (with one
    kv head, wk and wv replicated whole)."""
    args = model_args(family, vocab_size=258, **shape)
    model = apply_tensor_parallel(build_model(args), fake_tp_mesh, sequence_parallel=False)
    held = sum(local_shard(p).numel() for p in model.parameters())
    assert held == rank_params(args, Layout(dp=1, tp=2), 0)
    assert held < num_params(args)


def test_pipeline_ranks_split_blocks_and_hold_the_ends():
    """70 blocks over 12 stages: 6 on the first ten, 5 on the last two; the first stage
    holds the embedding, the last the final norm and a copy of the tied head."""
    args = model_args("gpt2-small")  # tied embeddings
    lay = Layout(dp=1, pp=12, microbatches=12)
    big = model_args("gpt2-small", n_layers=70)
    assert [rank_blocks(70, lay, r) for r in range(12)] == [6] * 10 + [5] * 2
    table, h = args.vocab_size * args.d_model, args.d_model
    block = (num_params(args, exclude_embeddings=True) - 2 * h) // args.n_layers
    assert rank_params(big, lay, 0) == 6 * block + table + args.max_seq_len * h
    assert rank_params(big, lay, 5) == 6 * block
    assert rank_params(big, lay, 11) == 5 * block + 2 * h + table  # final LayerNorm, head copy
    total = sum(rank_params(big, lay, r) for r in range(12))
    assert total == num_params(big) + table  # the head copy is the only duplicate
    interleaved = Layout(dp=1, pp=4, virtual_stages=2, schedule="interleaved_1f1b")
    assert sum(rank_blocks(70, interleaved, r) for r in range(4)) == 70


@pytest.mark.parametrize("p,m", [(4, 8), (8, 64), (12, 120)])
def test_in_flight_micro_batches_and_bubble(p, m):
    gpipe = Layout(dp=1, pp=p, microbatches=m, schedule="gpipe")
    one_f = Layout(dp=1, pp=p, microbatches=m, schedule="1f1b")
    assert [in_flight(gpipe, r) for r in range(p)] == [m] * p
    assert [in_flight(one_f, r) for r in range(p)] == list(range(p, 0, -1))
    assert bubble(gpipe) == bubble(one_f) == pytest.approx((p - 1) / (m + p - 1))
    for v in (2, 4):
        lay = Layout(dp=1, pp=p, microbatches=m, schedule="interleaved_1f1b", virtual_stages=v)
        # Korthikanti et al. 2022, section 4.2.3: the first stage's memory x (1 + (p-1)/(pv)).
        assert in_flight(lay, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))
        assert bubble(lay) == pytest.approx((p - 1) / (v * m + p - 1))
        looped = Layout(dp=1, pp=p, microbatches=m, schedule="looped_bfs", virtual_stages=v)
        assert bubble(looped) == pytest.approx((p - 1) / (v * m + p - 1))
        assert in_flight(looped, 0) == m  # every forward of both stages before a backward


def test_p2p_bytes_are_bsh_per_micro_batch_and_boundary():
    args = model_args("gpt2-small")
    lay = Layout(dp=1, pp=4, micro_batch=2, microbatches=8)
    assert p2p_bytes(args, lay, 1024, 2) == 2 * (2 * 1024 * 768 * 2) * 8  # forward + backward
    v2 = Layout(
        dp=1, pp=4, micro_batch=2, microbatches=8, schedule="interleaved_1f1b", virtual_stages=2
    )
    assert p2p_bytes(args, v2, 1024, 2) == 2 * p2p_bytes(args, lay, 1024, 2)  # 2 boundaries
    assert p2p_bytes(args, Layout(dp=2), 1024, 2) == 0


def test_layouts_a_schedule_cannot_run_are_refused():
    """The config's own one-line checks (llm.config.pp_schedule_problem)."""
    with pytest.raises(ConfigError, match="places exactly 2 stages per rank in a V"):
        Layout(dp=1, pp=2, schedule="zbv_zero_bubble")
    with pytest.raises(ConfigError, match="at least as many micro-batches as stages"):
        Layout(dp=1, pp=4, microbatches=2)


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"])
def test_zero_bubble_schedules_fill_the_bubble(schedule):
    """Splitting backward into input and weight gradients lets torch's zero-bubble orders
    fill most of the interleaved schedule's idle time (Qi et al. 2023: about a third of
    1F1B's bubble for ZB-H1), and no rank holds more micro-batches than interleaved 1F1B's
    first rank."""
    p, m, v = 4, 8, 2
    zb = Layout(dp=1, pp=p, microbatches=m, schedule=schedule, virtual_stages=v)
    looped = Layout(dp=1, pp=p, microbatches=m, schedule="interleaved_1f1b", virtual_stages=v)
    assert 0 < bubble(zb) < bubble(looped) / 2
    assert max(in_flight(zb, r) for r in range(p)) <= in_flight(looped, 0)


def _workload(model: str, seq: int = 2048) -> Workload:
    return Workload(
        args=model_args(model),
        seq=seq,
        policy=resolve_precision("bf16", torch.device("cpu")),
        optimizer=_cfg().optimizer,
    )


def test_stage_memory_is_states_plus_in_flight_activations():
    """The first stage of a 1f1b pipeline: the ZeRO paper's bytes for its parameters, and
    p micro-batches of its blocks' activations (the formula, tp- and sp-split)."""
    w = _workload("gpt3-175b")
    lay = Layout(dp=8, tp=8, pp=8, zero_stage=1, micro_batch=1, microbatches=16)
    est = estimate_layout(w, lay, Cluster(8, 8, 80 * GIB, 312e12, 300e9, 25e9))
    first = est.by_stage["first"]
    n = rank_params(w.args, lay, 0)
    assert first["params"] == first["grads"] == 2 * n  # bf16
    assert first["optimizer_states"] == round(12 * n / 8)  # fp32 master + Adam, over dp
    layer = sum(layer_terms(w.args, 1, 2048, w.stream, device="cuda", tp=8).values())
    lookups = sum(
        v
        for k, v in outside_terms(w.args, 1, 2048, w.stream, device="cuda", tp=8).items()
        if k.startswith(("embed", "pos_embed"))
    )
    assert first["activations"] == 8 * (12 * layer + lookups)  # 96 blocks / 8 stages
    assert est.bytes_per_gpu == max(sum(s.values()) for s in est.by_stage.values())


def test_tensor_parallel_across_nodes_is_slower():
    """The same layout with tp=8 on 8-GPU nodes (NVLink) and on 4-GPU nodes (InfiniBand)."""
    w = _workload("gpt3-175b")
    lay = Layout(dp=4, tp=8, pp=8, zero_stage=1, recompute="full", microbatches=32)
    nvlink = estimate_layout(w, lay, Cluster(32, 8, 80 * GIB, 312e12, 300e9, 25e9))
    split = estimate_layout(w, lay, Cluster(64, 4, 80 * GIB, 312e12, 300e9, 25e9))
    assert split.step_time_s > 1.5 * nvlink.step_time_s
    assert split.bytes_per_gpu == nvlink.bytes_per_gpu


def _plan(model: str, nodes: int, batch: int, *extra: str):
    cfg = _cfg(
        f"model={model}",
        "data.seq_len=2048",
        f"estimate.nodes={nodes}",
        "estimate.gpus_per_node=8",
        f"estimate.global_batch={batch}",
        *extra,
    )
    # As python -m llm.estimate sizes it: the tokenizer's vocabulary where the model's config
    # names none (the published shapes' configs name theirs, docs/parallel.md's table).
    return plan(cfg, model_args_for(cfg, vocab_size=tokenizer_vocab_size(cfg)))


def test_plan_replicates_kv_heads_beyond_their_count():
    """llama-tiny's 2 kv heads (4 query heads) on an 8-GPU node: tp=4 replicates them and is
    planned, where before only a tp dividing 2 was; 3 kv heads (6 query heads) allow no
    tp=2, which divides the heads, d_model and d_ff but neither divides nor is a multiple
    of 3."""
    rows = _plan("llama-tiny", 1, 8, "data.seq_len=64")
    assert {r.layout.tp for r in rows} == {1, 2, 4}
    odd = ("model.n_heads=6", "model.n_kv_heads=3", "model.d_model=96", "model.d_ff=192")
    assert {r.layout.tp for r in _plan("llama-tiny", 1, 8, "data.seq_len=64", *odd)} == {1}


def _published(rows, dp, tp, pp, **fields):
    return [
        r
        for r in rows
        if (r.layout.dp, r.layout.tp, r.layout.pp) == (dp, tp, pp)
        and all(getattr(r.layout, k) == v for k, v in fields.items())
    ]


def test_bloom_176b_published_layout_fits_384_gpus():
    """BLOOM-176B: 48 nodes x 8 A100 80 GB, dp=8 x tp=4 x pp=12, ZeRO-1, micro-batch 2,
    global batch 2048 (BigScience 2022)."""
    rows = _plan("bloom-176b", 48, 2048)
    ours = _published(rows, 8, 4, 12, zero_stage=1, micro_batch=2)
    assert ours and any(r.fits for r in ours)
    assert ours[0].layout.microbatches == 128
    assert ours[0].bubble == pytest.approx(11 / (128 + 11))
    assert all(r.bytes_per_gpu <= 80 * GIB for r in rows if r.fits)


@pytest.mark.parametrize(
    "model,nodes,batch,tp,pp", [("gpt3-175b", 192, 1536, 8, 12), ("megatron-1t", 384, 3072, 8, 64)]
)
def test_megatron_published_layouts_fit(model, nodes, batch, tp, pp):
    """Narayanan et al. 2021: plain data parallel (no ZeRO) x tp=8 x pp over 8-GPU nodes,
    micro-batch 1, with activation recompute. 175B: Table 2's PTD-P run (model-parallel size
    96 = t 8 x p 12, batch 1536, on 1536 GPUs); 1T: Table 1's last row."""
    rows = _plan(model, nodes, batch)
    dp = nodes * 8 // (tp * pp)
    ours = _published(rows, dp, tp, pp, zero_stage=0, micro_batch=1, recompute="full")
    assert len(ours) == 1 and ours[0].fits
    # Replicated model states need the pipeline: at tp <= 8 alone they do not fit.
    assert not any(r.fits for r in rows if r.layout.pp == 1 and r.layout.zero_stage == 0)


def test_deepspeed_32_device_example_fits():
    """DeepSpeed's 3D example: 4 pipeline stages x 4 tensor ranks x 2 data-parallel
    replicas with ZeRO-1, here for llama2-7b on 4 nodes of 8 GPUs."""
    rows = _plan("llama2-7b", 4, 256)
    ours = _published(rows, 2, 4, 4, zero_stage=1)
    assert ours and all(r.fits for r in ours if r.layout.recompute == "full")


def _pp_cfg(*overrides):
    return _cfg(
        "model=gpt2-tiny",
        "model.n_layers=5",
        "data.seq_len=64",
        "train.micro_batch_size=8",
        "parallelism.pp_size=2",
        "launcher.nproc_per_node=2",
        "estimate.device=cpu",
        *overrides,
    )


@pytest.mark.parametrize("schedule,m", [("1f1b", 4), ("gpipe", 2)])
def test_pipeline_estimate_agrees_with_the_layout_arithmetic(schedule, m):
    """llm.estimate under pp sizes each rank's real part (3 of 5 blocks and the embeddings
    on stage 0; 2, the final norm and the tied head's copy on stage 1): its parameters equal
    the cluster layout's closed form, its activations in-flight micro-batches of b = 8/m
    through the stage's blocks and ends, and the largest stage is the one reported."""
    cfg = _pp_cfg(f"parallelism.pp_schedule={schedule}", f"parallelism.pp_microbatches={m}")
    args = model_args_for(cfg, vocab_size=257)
    est = estimate(cfg, args)
    lay = Layout(dp=1, pp=2, micro_batch=8 // m, microbatches=m, schedule=schedule)
    policy = resolve_precision("fp32", torch.device("cpu"))
    layer = sum(layer_terms(args, 8 // m, 64, policy).values())
    outside = outside_terms(args, 8 // m, 64, policy)
    lookups = sum(v for k, v in outside.items() if k.startswith(("embed", "pos_embed")))
    ends = [lookups, sum(outside.values()) - lookups]
    for r, stage in enumerate(est.stages):
        assert stage.rank == r and stage.device["params"] == 4 * rank_params(args, lay, r)
        per_micro_batch = rank_blocks(5, lay, r) * layer + ends[r]
        assert stage.device["activations"] == in_flight(lay, r) * per_micro_batch
    largest = max(est.stages, key=lambda s: s.total)
    assert (est.rank, est.device) == (largest.rank, largest.device)


def test_pipeline_estimate_of_a_v_shaped_schedule(capsys):
    """zbv_zero_bubble places stages 0 and 3 on rank 0: the embedding and the tied head are
    one parameter there, so the stages' parameters add up to the model's, no copy. The
    start-up estimate prints a line per stage."""
    cfg = _pp_cfg(
        "model.n_layers=4",
        "parallelism.pp_schedule=zbv_zero_bubble",
        "parallelism.pp_virtual_stages=2",
    )
    args = model_args_for(cfg, vocab_size=257)
    est = estimate(cfg, args)
    assert sum(s.device["params"] for s in est.stages) == 4 * num_params(args)
    assert all(s.device["activations"] > 0 for s in est.stages)
    announce_estimate(cfg, 2)
    out = capsys.readouterr().out
    assert "estimate pipeline stage 0 (rank 0)" in out and "estimate pipeline stage 1" in out


def test_startup_estimate_prints_every_stage(capsys):
    cfg = _pp_cfg("parallelism.pp_microbatches=4")
    announce_estimate(cfg, 2)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "estimate pipeline stage 0 (rank 0)",
        "estimate pipeline stage 1 (rank 1)",
        "estimate",
    ]
    assert "largest: pipeline stage" in lines[-1]
