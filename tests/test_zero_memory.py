"""Our ZeRO's PEAK model-state memory per rank (the tracker's high-water mark of a training
step, llm/memory/peak.py) against the paper's formulas, on 4 gloo ranks in bf16 mixed
precision with 8 blocks: 4Φ + 12Φ/N (stage 1), 2Φ + 14Φ/N (stage 2), 16Φ/N (stage 3), plus
extras each named and computed from the bucket layout.

The formulas are evaluated on the padded layout (Φ → the padded bucket elements, Φ/N → a
rank's slice S), so padding is no slack. The tracker counts params, grads and optimizer
states from what ``state_tensors()`` names; a gradient bucket born and freed within one
backward is "other" to it, but the buckets still in flight when autograd finishes are
named, so they are an extra here.
"""

from __future__ import annotations

import pytest
from helpers import run

from llm.models import build_model, model_args
from llm.parallel.zero.layout import build_buckets

NPROC = 4
SHAPE = {"n_layers": 8, "d_model": 32, "vocab_size": 257}  # the byte tokenizer: 256 + <eos>
BUCKET_MB = 0.02  # ~10k bf16 elements: several buckets, about one per block
IN_FLIGHT = 2  # parallelism.buckets_in_flight's default
BF16, FP32 = 2, 4  # bytes per element: working params; master, moments, reduced gradients


def _layout(stage: int):
    """The buckets our ZeRO builds for this run (on the meta device: no memory)."""
    model = build_model(model_args("gpt2-tiny", **SHAPE))
    blocks = list(model.layers)
    root = len(blocks) if stage == 3 else 0
    unit_of = {p: i for i, b in enumerate(blocks) for p in b.parameters()} if stage == 3 else {}
    named = [(n, p, unit_of.get(p, root)) for n, p in model.named_parameters()]
    named.sort(key=lambda item: item[2])
    numel = int(BUCKET_MB * 2**20 / BF16)
    return build_buckets(named, numel, NPROC), root


def _expected(stage: int, rank: int) -> tuple[dict[str, int], dict[str, int]]:
    """(the paper's bytes plus what is always there, bounded extras) by name."""
    buckets, root = _layout(stage)
    padded = sum(b.padded for b in buckets)  # Φ, padded
    shard = sum(b.shard for b in buckets)  # Φ/N, padded
    paper = {1: 4 * padded + 12 * shard, 2: 2 * padded + 14 * shard, 3: 16 * shard}[stage]
    fixed = {
        f"paper ({['4Φ+12Φ/N', '2Φ+14Φ/N', '16Φ/N'][stage - 1]})": paper,
        # Gradients accumulate in fp32 in the shard; the paper counts a 16-bit gradient
        # (stage 1: the full 16-bit buffer only, so the whole fp32 shard is extra).
        "fp32 gradient shard": (FP32 if stage == 1 else FP32 - BF16) * shard,
        "AdamW step tensors (4 B per piece)": 4 * sum(len(b.pieces(rank)) for b in buckets),
    }
    largest = max(b.padded for b in buckets)
    unit_bytes = {}
    for b in buckets:
        unit_bytes[b.unit] = unit_bytes.get(b.unit, 0) + BF16 * b.padded
    biggest_param = max(s.numel for b in buckets for s in b.slots)
    bounded = {
        # fp32 full-size input (stage 1: a copy of the 16-bit bucket) + fp32 output slice.
        f"{IN_FLIGHT} gradient buckets in flight": IN_FLIGHT * FP32 * (largest + largest // NPROC),
        "one parameter's fresh gradient": BF16 * biggest_param,
    }
    if stage == 3:
        blocks = sorted((v for u, v in unit_bytes.items() if u != root), reverse=True)
        bounded["gathered blocks (current + next)"] = sum(blocks[:2])
        bounded["gathered root"] = unit_bytes[root]
    return fixed, bounded


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.slow
def test_peak_model_state_follows_the_paper(tmp_path, text_corpus, cache_dir, stage):
    summary, _ = run(
        tmp_path,
        f"zero{stage}",
        text_corpus,
        cache_dir,
        f"parallelism=zero{stage}",
        f"launcher.nproc_per_node={NPROC}",
        "precision=bf16",
        *(f"model.{k}={v}" for k, v in SHAPE.items() if k != "vocab_size"),
        f"parallelism.bucket_cap_mb={BUCKET_MB}",
        "train.micro_batch_size=1",
        "data.seq_len=16",
        "train.max_steps=3",
        "train.memory_tracking=alternate",
    )
    assert summary["n_params"] == sum(s.numel for b in _layout(stage)[0] for s in b.slots), (
        "the layout above is not the run's"
    )
    for rank, peak in enumerate(summary["memory_peak"]):
        fixed, bounded = _expected(stage, rank)
        state = peak["params"] + peak["grads"] + peak["optimizer_states"]
        low, high = sum(fixed.values()), sum(fixed.values()) + sum(bounded.values())
        terms = ", ".join(f"{k} {v:,}" for k, v in {**fixed, **bounded}.items())
        assert low <= state <= high, (
            f"rank {rank} peak ({peak['phase']}) params+grads+optimizer_states {state:,} "
            f"not in [{low:,}, {high:,}] = {terms}"
        )


def test_layout_has_eight_blocks_and_several_buckets():
    buckets, root = _layout(3)
    assert root == 8 and len({b.unit for b in buckets}) == 9
    assert len(_layout(2)[0]) >= 8
