"""Parameter and FLOP counts of mixture-of-experts shapes (llm.models.counting): the total
against the meta-built model, the active count by hand and against the published figures,
and the FLOPs against torch's own counter on one forward + backward of moe-tiny."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from llm.models import (
    MODEL_SHAPES,
    build_model,
    causal_flops_per_token,
    flops_per_token,
    materialize,
    model_args,
    num_active_params,
    num_params,
)

# moe-tiny with 4 blocks, 2 shared experts, MoE every second block after the first (blocks
# 1 and 3 MoE, 0 and 2 dense) and the sigmoid router, whose bias is a buffer.
VARIANT = model_args(
    "moe-tiny",
    n_layers=4,
    moe={"n_shared_experts": 2, "every": 2, "first_dense": 1, "router": "sigmoid"},
)
SHAPES = {
    "moe-tiny": MODEL_SHAPES["moe-tiny"],
    "mixtral-8x7b": MODEL_SHAPES["mixtral-8x7b"],
    "deepseek-moe-16b": MODEL_SHAPES["deepseek-moe-16b"],
    "moe-tiny-shared-every2-sigmoid": VARIANT,
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_num_params_equals_the_meta_built_model(name):
    args = SHAPES[name]
    model = build_model(args)
    assert num_params(args) == sum(p.numel() for p in model.parameters())  # tied once
    assert num_active_params(args) < num_params(args)


def test_the_sigmoid_routers_bias_is_a_buffer_not_counted():
    model = build_model(VARIANT)
    assert [b for b in model.layers[0].feed_forward.buffers()] == []  # a dense block
    router = model.layers[1].feed_forward.router
    assert "bias" in dict(router.named_buffers()) and "bias" not in dict(router.named_parameters())


def test_moe_tiny_counts_by_hand():
    a = MODEL_SHAPES["moe-tiny"]  # d 64, 2 blocks, 4 heads of 16, 2 kv heads; 8 experts of 96
    d, v = 64, 4096
    attention = 2 * d * d + 2 * d * 2 * 16  # wq, wo; wk, wv
    norms = 2 * d
    gate = 8 * d
    expert = 3 * d * 96
    tables = 2 * v * d  # untied: token table and output head
    body_active = 2 * (attention + norms + gate + 2 * expert) + d  # + final norm
    body_total = 2 * (attention + norms + gate + 8 * expert) + d
    assert num_active_params(a, exclude_embeddings=True) == body_active == 99_648
    assert num_active_params(a) == body_active + tables == 623_936
    assert num_params(a, exclude_embeddings=True) == body_total == 320_832
    assert num_params(a) == body_total + tables == 845_120


def test_variant_counts_by_hand():
    a = VARIANT  # blocks 0, 2 dense (d_ff 192); 1, 3 MoE with 2 shared experts of width 96
    d = 64
    common = 2 * d * d + 2 * d * 32 + 2 * d
    dense = 3 * d * 192
    moe_active = 8 * d + (2 + 2) * 3 * d * 96  # gate, top-2 routed and 2 shared experts
    moe_total = 8 * d + (8 + 2) * 3 * d * 96
    body = 4 * common + 2 * dense + d
    assert num_active_params(a, exclude_embeddings=True) == body + 2 * moe_active
    assert num_params(a, exclude_embeddings=True) == body + 2 * moe_total


def test_a_dense_models_active_count_is_its_count():
    for name in ("gpt2-tiny", "llama-tiny", "llama3-8b", "gpt2-small"):
        for exclude in (False, True):
            args = MODEL_SHAPES[name]
            assert num_active_params(args, exclude_embeddings=exclude) == num_params(
                args, exclude_embeddings=exclude
            )


@pytest.mark.parametrize(
    ("name", "total", "active", "rel"),
    [
        ("mixtral-8x7b", 46.7e9, 12.9e9, 5e-3),  # Mistral AI's "46.7B total, 12.9B active"
        ("deepseek-moe-16b", 16.4e9, 2.8e9, 2e-2),  # Dai et al. 2024: 16.4B, 2.8B activated
    ],
)
def test_published_total_and_active_counts(name, total, active, rel):
    """The published figures count the embeddings (token table and, untied, the head)."""
    args = MODEL_SHAPES[name]
    assert num_params(args) == pytest.approx(total, rel=rel)
    assert num_active_params(args) == pytest.approx(active, rel=rel)


def test_moe_tiny_flops_are_six_active_params_plus_attention():
    a = MODEL_SHAPES["moe-tiny"]
    seq, d_attn = 128, a.n_heads * a.head_dim
    n_matmul = num_active_params(a, exclude_embeddings=True) + a.vocab_size * a.d_model
    assert flops_per_token(a, seq) == 6 * n_matmul + 12 * a.n_layers * seq * d_attn
    assert causal_flops_per_token(a, seq) == 6 * n_matmul + 6 * a.n_layers * (seq + 1) * d_attn
    # By hand: per block attention, norms, the gate (64 x 8, it counts) and 2 of 8 experts
    # of 3 * 64 * 96; the final norm; the output head (4096 x 64, a matmul).
    block = (2 * 64 * 64 + 2 * 64 * 32) + 2 * 64 + 64 * 8 + 2 * 3 * 64 * 96
    assert n_matmul == 2 * block + 64 + 4096 * 64


BATCH, SEQ = 2, 64


def test_moe_tiny_flops_equal_torchs_count():
    """One forward + backward of moe-tiny in fp32, eager attention and the loop expert
    kernel (one F.linear per expert, which the counter sees; dropless, so every token's
    top_k experts run). The counter's matmul FLOPs match 6 * N_active + attention within
    0.5%, and its FLOPs less the attention's are the formula's dense part 6 * N_active less
    the norm gains, which ride in N but are no matmuls."""
    base = MODEL_SHAPES["moe-tiny"]
    args = dataclasses.replace(base, moe=dataclasses.replace(base.moe, kernel="loop"))
    model = materialize(build_model(args, "eager"), "cpu", seed=0)
    data = torch.randint(
        0, args.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0)
    )
    with FlopCounterMode(display=False) as counter:
        logits = model(data[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten()).backward()
    tokens = BATCH * SEQ
    counted = counter.get_total_flops()
    assert counted == pytest.approx(flops_per_token(args, SEQ) * tokens, rel=5e-3)
    attention = 12 * args.n_layers * SEQ * args.n_heads * args.head_dim * tokens
    n_matmul = num_active_params(args, exclude_embeddings=True) + args.vocab_size * args.d_model
    assert counted - attention == pytest.approx(6 * n_matmul * tokens, rel=5e-3)
    # Exactly: the formula's N less the norm gains (two per block and the final one).
    norms = (2 * args.n_layers + 1) * args.d_model
    assert counted - attention == 6 * (n_matmul - norms) * tokens
    # Every expert in the 6N term instead of top_k would overcount by half as much again.
    all_experts = num_params(args, exclude_embeddings=True) + args.vocab_size * args.d_model
    assert counted < 0.7 * (6 * all_experts * tokens + attention)
