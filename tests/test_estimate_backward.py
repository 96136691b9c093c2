"""The estimator's second moment (llm.estimate.backward_peak): sharded layouts' rows early in
backward, each term counted from the model's own parameters, and the total the larger of
the two moments. The rehearsals it is checked against are in tests/test_rehearse.py."""

from __future__ import annotations

import pytest
from helpers import compose_config

from llm.build import model_args_for
from llm.estimate.estimator import estimate, meta_model
from llm.models import model_blocks


def _estimate(*overrides, world: int = 8):
    """gpt2-tiny at a byte-sized vocabulary and one sequence, where the blocks' point is larger than the
    loss's (the other point: ``test_a_large_vocabulary_puts_the_moment_at_the_loss``)."""
    cfg = compose_config(
        [
            "logger=none",
            "output_dir=unused",
            "model=gpt2-tiny",
            "data.seq_len=64",
            "data.vocab_size=257",
            "train.micro_batch_size=1",
            "precision=fp32",
            f"estimate.gpus_per_node={world}",
            *overrides,
        ]
    )
    args = model_args_for(cfg, vocab_size=cfg.data.vocab_size)
    return estimate(cfg, args), meta_model(cfg, args.padded(cfg.model.vocab_multiple))


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("prefetch, gathered_blocks", [(True, 2), (False, 1)])
def test_zero3_backward_gathers_the_root_and_the_blocks_its_prefetch_holds(
    prefetch, gathered_blocks
):
    """fp32 (4-byte units): parameters at the backward moment are the shards plus the
    whole root and one or two whole blocks (their buckets padded to a shard boundary)."""
    est, model = _estimate(
        "parallelism=zero3", f"parallelism.prefetch={str(prefetch).lower()}", world=2
    )
    blocks = model_blocks(model)
    root = _numel(model) - sum(_numel(b) for b in blocks)
    gathered = 4 * (root + gathered_blocks * _numel(blocks[-1]))
    assert est.backward["params"] - est.device["params"] == pytest.approx(gathered, rel=1e-3)
    assert est.backward["optimizer_states"] == est.device["optimizer_states"]


def test_zero3_one_bucket_per_block_holds_two_buckets_and_the_largest_gradient():
    """With buckets wider than a block each block is one bucket (fp32, 2 ranks): at the
    most, in the backward of the block before the last, the last block's bucket is still
    in flight (its full size and its half-size output), beside the block's own bucket and
    the gradient autograd just made for its largest parameter; the root's gradient bucket
    (final norm and tied head) sits beside the shards."""
    est, model = _estimate("parallelism=zero3", "parallelism.bucket_cap_mb=1000", world=2)
    block = model_blocks(model)[-1]
    largest = max(p.numel() for p in block.parameters())
    assert est.backward["reduce_buckets"] == pytest.approx(
        4 * (2.5 * _numel(block) + largest), rel=1e-3
    )
    root = _numel(model) - sum(_numel(b) for b in model_blocks(model))
    assert est.backward["grads"] - est.device["grads"] == pytest.approx(4 * root, rel=1e-3)


def test_fsdp_backward_holds_four_unsharded_blocks_and_one_block_of_gradient_shards():
    """fp32: four whole blocks, one block's gradient shard in place of the whole gradient
    shard, no gathered weights saved (the last block is resharded by then); the total is
    the larger moment's, in the JSON too."""
    est, model = _estimate("parallelism=fsdp", world=4)
    block = _numel(model_blocks(model)[-1])
    assert est.backward["unsharded_blocks"] == 4 * 4 * block
    assert est.backward["grads"] == 4 * block // 4
    assert "gathered_weights" in est.device and "gathered_weights" not in est.backward
    assert est.backward["optimizer_states"] == est.device["optimizer_states"]
    forward, backward = sum(est.device.values()), sum(est.backward.values())
    assert est.total == max(forward, backward) == est.to_json()["total_bytes"]


@pytest.mark.parametrize("layout", ["zero3", "fsdp"])
def test_a_large_vocabulary_puts_the_moment_at_the_loss(layout):
    """At the loss's backward every activation is saved beside nll_loss's and log_softmax's
    fp32 gradients of the logits' size, and the root is gathered: with a vocabulary of 8,192
    at width 64 that point is larger than the blocks'. FSDP2 has no gradient yet and holds
    the lookup tables, which nothing saved, as a row of their own."""
    est, model = _estimate(f"parallelism={layout}", "data.vocab_size=8192", world=4)
    b, s, v = 1, 64, model.args.vocab_size
    assert est.backward["loss_backward"] == 2 * b * s * v * 4
    assert "unsharded_blocks" not in est.backward and "reduce_buckets" not in est.backward
    assert est.backward["activations"] == est.device["activations"]
    root = _numel(model) - sum(_numel(b) for b in model_blocks(model))
    if layout == "fsdp":
        assert est.backward["grads"] == 0
        # gpt2's head is tied to the token table, which autograd saves with the head
        assert est.backward["root_gathered"] == 4 * _numel(model.pos_embeddings)
    else:
        assert est.backward["params"] - est.device["params"] == pytest.approx(4 * root, rel=1e-3)
    assert est.total == sum(est.backward.values())


def test_fsdp_without_resharding_keeps_the_forward_total():
    """Unsharded parameters over several ranks (FSDP2 without resharding) have no second
    moment: the total is the end-of-forward rows'. One device has its own moments
    (tests/test_estimate_single_moments.py), ZeRO-1 and -2 theirs
    (tests/test_estimate_zero_buckets_backward.py)."""
    est, _ = _estimate("parallelism=fsdp", "parallelism.reshard_after_forward=false", world=4)
    assert est.backward is None
    assert est.total == sum(est.device.values())
