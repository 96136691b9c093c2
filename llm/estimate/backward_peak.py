"""The second moment of a sharded rank's step: early in backward, when the blocks are gathered
again and their gradients exist at full size, beside nearly every saved activation. The
estimate's total is the larger of this moment and the end of forward (estimator.py).

Under ``parallelism=zero3`` (our ZeRO, llm/parallel/zero), during the last blocks' backward:
- gathered units (gather.py): the root, kept gathered from the first forward to the end of
  backward, the block computing and, with ``prefetch``, the one before it;
- the root's gradient buckets that a final norm or head fills before the blocks' backward
  (a bucket's full-size gradient exists from its first gradient, buffers.py ``take_grad``;
  the root's buckets are launched last, reducer.py). An embedding's gradient arrives at the
  end of backward (a tied head's too: autograd accumulates it once, after the lookup);
- the gradient buckets in flight over the last two blocks' backward: reducer.py launches a
  block's buckets last one first as each completes, at most ``buckets_in_flight`` pending (launching one more first
  retires the oldest), and the bucket being filled holds its full-size gradient beside the
  gradient autograd just made for one of its parameters (in the working dtype, until
  ``take_grad`` copies it in).

Under ``parallelism=fsdp`` with ``reshard_after_forward`` (torch's FSDP2, _fully_shard),
at the reduce-scatter of the second block's gradients (measured on gpt2 at 8 to 16 ranks,
docs/parallel.md): four unsharded blocks beside the shards (the block's unsharded gradients
and its reduce-scatter input, the previous block's reduce-scatter input, the block before
it gathered ahead by FSDP2's backward prefetch), and one block's gradient shard so far in
place of the whole gradient.

Both count every saved activation (the forward's figure): an upper bound by the share of
the last blocks already freed, a block's in a model of ``n_layers``.

The loss's backward, the first point of backward, is the other candidate, and the larger
of the two is the moment (its rows name it: ``loss_backward``). Every activation is still
saved, beside the loss's gradients (``loss_backward_bytes``: two fp32 tensors of the
logits' size, or what a fused loss makes); the root's parameters are gathered (our ZeRO-3
keeps the root gathered from the first forward to the end of backward; FSDP2's root is
never resharded after forward, llm/parallel/fsdp.py), and where autograd did not save them
(the lookup tables: an embedding's backward keeps the indices) they are a row of their
own, ``root_gathered``. Measured with the rehearsal's tracker at a vocabulary 32 times the
width (llama3-8b's proportions): without it the estimate was a third under.

ZeRO-1 and -2 have theirs in llm.estimate.zero_buckets_backward. Other layouts (tensor or
pipeline parallel, experts, FSDP2 without resharding) have no second moment here.
"""

from __future__ import annotations

from torch import nn

from llm.config import ParallelismConfig
from llm.models import model_blocks
from llm.parallel.zero.layout import Bucket, model_buckets
from llm.precision import PrecisionPolicy


def backward_rows(
    model: nn.Module,
    par: ParallelismConfig,
    policy: PrecisionPolicy,
    forward: dict[str, int],
    world: int,
    loss_backward: int,
) -> dict[str, int] | None:
    """The rank's rows at the backward moment, from ``forward`` (the end-of-forward rows:
    model states and activations) and the bytes the loss's backward makes, or None where
    the layout has none here."""
    if par.tp_size > 1 or par.pp_size > 1 or par.ep_size > 1 or world == 1:
        return None
    w = policy.working_dtype.itemsize
    if par.name == "zero3":
        buckets = model_buckets(model, 3, par.bucket_cap_mb, w, world)
        root = sum(b.padded for b in buckets if b.unit == len(model_blocks(model)))
        loss = {**forward, "params": forward["params"] + w * root}
        blocks = _zero3(model, par, policy, forward, buckets)
    elif par.name == "fsdp" and par.reshard_after_forward:
        loss = {**forward, "grads": 0, "root_gathered": w * _lookup_tables(model)}
        blocks = _fsdp(model, policy, forward, world)
    else:
        return None
    loss["loss_backward"] = loss_backward
    return max((loss, blocks), key=lambda rows: sum(rows.values()))


def _lookup_tables(model: nn.Module) -> int:
    """Elements of the embedding tables no other module uses (a tied head saves its weight
    for backward, so that one is counted with the saved activations)."""
    head = model.output.weight
    return sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Embedding) and m.weight is not head
    )


def _zero3(model, par, policy, forward: dict[str, int], buckets: list[Bucket]) -> dict[str, int]:
    w, r = policy.working_dtype.itemsize, policy.reduce_dtype.itemsize
    n_blocks = len(model_blocks(model))
    root = [b for b in buckets if b.unit == n_blocks]
    last_two = [b for b in buckets if b.unit >= n_blocks - 2 and b.unit != n_blocks]
    gathered_blocks = [n_blocks - 1] + ([n_blocks - 2] if par.prefetch and n_blocks > 1 else [])
    gathered = sum(b.padded for b in buckets if b.unit in gathered_blocks)
    gathered += sum(b.padded for b in root)
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    early = [
        b
        for b in root
        if b.trainable and any(id(s.param) not in lookups for s in b.slots)  # final norm, head
    ]
    rows = dict(forward)
    rows["params"] += w * gathered
    rows["grads"] += r * sum(b.padded for b in early)
    rows["reduce_buckets"] = _buckets_in_flight(last_two, par.buckets_in_flight, w, r)
    return rows


def _buckets_in_flight(block: list[Bucket], in_flight: int, w: int, r: int) -> int:
    """The most bytes the gradient buckets of the last blocks (``block``) hold at once in
    their backward, following reducer.py: the pending reduce-scatters (full-size input and
    shard output; the last block's still pending when the one before it starts), the bucket
    being filled and the gradient autograd made for its largest parameter."""
    pending: list[int] = []
    most = 0
    for b in sorted((b for b in block if b.trainable), key=lambda b: -b.index):
        largest = max(s.numel for s in b.slots)
        most = max(most, sum(pending) + r * b.padded + w * largest)
        if len(pending) >= max(1, in_flight):
            pending.pop(0)
        pending.append(r * (b.padded + b.shard))
    return most


def _fsdp(model, policy, forward: dict[str, int], world: int) -> dict[str, int]:
    w, r, m = (
        policy.working_dtype.itemsize,
        policy.reduce_dtype.itemsize,
        policy.master_dtype.itemsize,
    )
    block = max((sum(p.numel() for p in b.parameters()) for b in model_blocks(model)), default=0)
    rows = {k: v for k, v in forward.items() if k != "gathered_weights"}  # resharded by now
    rows["grads"] = m * -(-block // world)
    # gathered ahead and unsharded gradients in the working dtype, two reduce-scatter inputs
    rows["unsharded_blocks"] = block * (2 * w + 2 * r)
    return rows
