"""python -m llm.estimate estimate.mode=inference: a tensor-parallel rank's weights equal what
apply_tensor_parallel leaves it, the KV cache equals a real cache's tensor, the working
memory equals the peak tracker's measure of a prefill and a decode step, the fit answers are
consistent, and bad input is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from helpers import compose_config

from llm.build import model_args_for, tokenizer_vocab_size
from llm.errors import ConfigError
from llm.estimate.estimator import with_overrides
from llm.estimate.inference import decode_bytes, estimate_inference, prefill_bytes
from llm.inference.forward import decode, prefill
from llm.inference.kv_cache import ContiguousKVCache, PagedKVCache
from llm.memory import PeakTracker
from llm.models import build_model, materialize, model_args
from llm.parallel.tensor_parallel import apply_tensor_parallel, local_tensor, padded_vocab

BASE = ["logger=none", "output_dir=unused", "estimate.mode=inference"]


def _config(*overrides: str):
    cfg = compose_config([*BASE, *overrides])
    return cfg, model_args_for(cfg, vocab_size=tokenizer_vocab_size(cfg))


def _sharded(args, tp: int, rank: int):
    """``args``' model on the meta device after apply_tensor_parallel, as tp rank ``rank``
    of ``tp`` holds it (torch's fake process group: no other process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model = build_model(args)
    if tp == 1:
        return model
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        return apply_tensor_parallel(model, mesh, sequence_parallel=False)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    ("model", "vocab"),
    [
        ("gpt2-small", 50257),  # padded to 50,258 at tp 2 and 50,260 at tp 4
        ("llama-1b", 128256),  # GQA, 8 kv heads split over tp
        ("llama-tiny", 4095),  # 2 kv heads: replicated at tp 4
    ],
)
def test_weights_and_cache_equal_what_a_tp_rank_holds(model, vocab, tp):
    """Weights: the bytes of the parameters rank 0 and the last rank hold after
    apply_tensor_parallel (a tied head once). KV cache: a cache built with the kv heads the
    sharded attention computes with (n_kv_heads / tp, or 1 where tp replicates them)."""
    overrides = [f"model={model}", f"model.vocab_size={vocab}", f"parallelism.tp_size={tp}"]
    overrides += ["estimate.batch=3", "estimate.context=128", "generate.dtype=bf16"]
    cfg, args = _config(*overrides)
    padded = dataclasses.replace(args, vocab_size=padded_vocab(vocab, tp))
    for rank in sorted({0, tp - 1}):
        est = estimate_inference(with_overrides(cfg, estimate={"rank": rank}), args)
        sharded = _sharded(padded, tp, rank)
        held = sum(local_tensor(p).numel() for p in sharded.parameters())
        assert est.n_params_per_rank == held
        assert est.device["weights"] == 2 * held, f"rank {rank}"
        # The rank's attention: its query and kv heads, of the whole model's head_dim.
        attn = sharded.layers[0].attention
        heads = {"n_heads": attn.n_heads, "n_kv_heads": attn.n_kv_heads}
        local = dataclasses.replace(padded, d_model=attn.n_heads * args.head_dim, **heads)
        cache = ContiguousKVCache(local, rows=3, row_len=128, dtype=torch.bfloat16, device="meta")
        assert est.device["kv_cache"] == cache.nbytes()
    if tp > 1:
        whole = estimate_inference(with_overrides(cfg, parallelism={"tp_size": 1}), args)
        assert est.device["weights"] < whole.device["weights"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kv_cache_of_mha_gqa_and_mqa_equals_a_real_cache(dtype):
    """The same llama shape with 4 (MHA), 2 (GQA) and 1 (MQA) kv heads: the cache row equals
    ContiguousKVCache(rows=batch, row_len=context).nbytes() and its tensor's own bytes, and
    shrinks by n_heads / n_kv_heads."""
    sizes = {}
    for kv_heads in (4, 2, 1):
        cfg, args = _config(
            "model=llama-tiny",
            f"model.n_kv_heads={kv_heads}",
            "estimate.batch=5",
            "estimate.context=200",
            f"generate.dtype={dtype}",
        )
        est = estimate_inference(cfg, args)
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        cache = ContiguousKVCache(args, rows=5, row_len=200, dtype=torch_dtype, device="cpu")
        assert est.device["kv_cache"] == cache.nbytes()
        assert est.device["kv_cache"] == cache.kv.numel() * cache.kv.element_size()
        sizes[kv_heads] = est.device["kv_cache"]
    assert sizes[4] == 2 * sizes[2] == 4 * sizes[1]


def _measured(args, batch: int, context: int, paged: bool) -> tuple[int, int]:
    """Peak bytes beyond weights and cache (the tracker's "other") of a prefill of one
    ``context``-token prompt, and of a decode step of ``batch`` sequences of ``context``
    tokens, fp32 on CPU."""
    model = materialize(build_model(args), "cpu", 0).eval()
    if paged:
        blocks = batch * -(-context // 16)
        cache = PagedKVCache(args, blocks, 16, torch.float32, "cpu")
    else:
        cache = ContiguousKVCache(args, batch, context, torch.float32, "cpu")
    tracker = PeakTracker(torch.device("cpu"), mode="alternate")
    tracker.watch(lambda: {"params": [*model.parameters(), cache.kv]})
    prompt = context - 1  # the new token is the context's last
    for seq in range(batch):
        cache.add(seq, prompt)
        with tracker.region(f"prefill{seq}"):
            prefill(model, torch.randint(0, args.vocab_size, (1, prompt)), cache, [seq])
        cache.extend(seq, 1)
    with tracker.region("decode"):
        decode(model, torch.randint(0, args.vocab_size, (batch,)), cache, list(range(batch)))
    return tracker.by_phase["prefill0"]["other"], tracker.by_phase["decode"]["other"]


@pytest.mark.parametrize(
    "overrides",
    [
        {"name": "llama-tiny"},  # logits (V = 4096) set the prefill's peak
        {"name": "llama-tiny", "vocab_size": 256},  # the MLP does
        {"name": "llama-tiny", "vocab_size": 256, "n_kv_heads": 1},
        {"name": "gpt2-tiny", "vocab_size": 256},
    ],
)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.slow
def test_working_memory_equals_the_measured_peak(overrides, paged):
    """The peak tracker's live bytes beyond weights and cache. A prefill: within 5% (the
    residual stream three times and the larger of logits and the MLP's peak, per token).
    A decode step: at least one layer's K and V gathered from the cache, at most our bound
    (that plus the per-token terms, which do not all peak with the read) and 5% (the paged
    cache reads whole blocks)."""
    args = model_args(**overrides)
    batch, context = 8, 200
    measured_prefill, measured_decode = _measured(args, batch, context, paged)
    expected_prefill = prefill_bytes(args, context - 1, 1, torch.float32)
    assert measured_prefill == pytest.approx(expected_prefill, rel=0.05)
    read = batch * context * 2 * args.n_kv_heads * args.head_dim * 4  # one layer's K and V
    assert read < measured_decode <= 1.05 * decode_bytes(args, batch, context, 1, torch.float32)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_largest_batch_and_longest_context_fit_and_one_more_does_not(tp):
    """llama3-8b in bf16 on 24 GiB: the largest batch at 8192 tokens fits, one more does
    not; the longest context at batch 16 x tp fits, one token more does not."""
    batch = 16 * tp  # too many sequences of max_seq_len tokens to fit
    memory = ["estimate.device_memory_gb=24", f"parallelism.tp_size={tp}"]
    cfg, args = _config(
        "model=llama3-8b", f"estimate.batch={batch}", "estimate.context=8192", *memory
    )
    est = estimate_inference(cfg, args)
    assert est.max_batch > 0 and 0 < est.max_context < args.max_seq_len

    def fits(b: int, c: int) -> bool:
        at = with_overrides(cfg, estimate={"batch": b, "context": c})
        return estimate_inference(at, args).fits

    assert fits(est.max_batch, 8192) and not fits(est.max_batch + 1, 8192)
    assert fits(batch, est.max_context) and not fits(batch, est.max_context + 1)


def test_nothing_fits_where_the_weights_alone_do_not():
    """llama3-8b's 16 GB of bf16 weights on an 8 GiB device: no batch, no context."""
    cfg, args = _config("model=llama3-8b", "estimate.device_memory_gb=8", "estimate.context=64")
    est = estimate_inference(cfg, args)
    assert not est.fits and est.device["weights"] > est.device_memory
    assert (est.max_batch, est.max_context) == (0, 0)


def _cli(tmp_path, *overrides: str, check: bool = True):
    argv = [sys.executable, "-m", "llm.estimate", "logger=none", f"hydra.run.dir={tmp_path}/h"]
    return subprocess.run([*argv, *overrides], check=check, capture_output=True, text=True)


def test_cli_prints_and_writes_the_inference_estimate(tmp_path):
    out = tmp_path / "est.json"
    overrides = [
        "estimate.mode=inference",
        "model=llama-1b",
        "model.vocab_size=128256",
        "estimate.batch=8",
        "estimate.context=4096",
        "parallelism.tp_size=2",
    ]
    proc = _cli(tmp_path, *overrides, f"estimate.json={out}")
    data = json.loads(out.read_text())
    assert data["mode"] == "inference" and data["tp"] == 2
    assert data["total_bytes"] == sum(data["device_bytes"].values())
    cfg, args = _config(*overrides)
    est = estimate_inference(cfg, args)
    assert data["device_bytes"] == est.device and data["max_batch"] == est.max_batch
    assert f"{est.total:,}" in proc.stdout and "largest batch at context 4,096" in proc.stdout


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=llama-tiny", "estimate.context=257"], "estimate.context=257 is longer than"),
        (["estimate.batch=0"], r"estimate.batch=0 must be > 0"),
        (["estimate.mode=serve"], "estimate.mode='serve' is unknown"),
        (["model=llama-tiny", "parallelism.tp_size=3"], "n_heads=4 is not divisible by"),
        (["model=moe-tiny", "parallelism.tp_size=2"], "tensor parallel does not split MoE"),
        (["parallelism.pp_size=2"], "splits over tensor parallel only"),
        (["estimate.num_params=7e9"], "drop estimate.num_params and estimate.plan"),
    ],
)
def test_bad_input_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        estimate_inference(*_config(*overrides))


def test_inference_keys_in_training_mode_are_refused_by_the_cli(tmp_path):
    """estimate.batch without estimate.mode=inference would size nothing: one line, exit 2."""
    proc = _cli(tmp_path, "estimate.batch=8", check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "add estimate.mode=inference" in lines[0], proc.stderr
