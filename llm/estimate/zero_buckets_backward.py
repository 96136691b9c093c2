"""The backward moment of a ZeRO-1 or ZeRO-2 rank (our ZeRO, llm/parallel/zero, without
tensor, pipeline or expert parallel): a replica's points (llm.estimate.single_moments) with
the gradient buckets live at each.

Stages 1-2 bucket the parameters in model order (llm/parallel/zero/layout.py), and
reducer.py launches the buckets last one first as each completes, at most
``buckets_in_flight`` pending (launching one more first retires the oldest):
- stage 2: a bucket's full-size gradient in the reduce dtype exists from its first gradient
  (buffers.py ``take_grad``) until its reduce-scatter is retired;
- stage 1: the full-size gradient persists in the working dtype (in the forward's rows); a
  launched bucket adds its copy in the reduce dtype where the dtypes differ;
- both: a launched bucket's output, one shard in the reduce dtype, until retired.

Gradients arrive head and final norm first, the blocks last one first, the lookups last (a
tied head's with the lookup's: autograd adds the two before the hook sees them). The
points, the largest of which is the moment:
- the loss's backward: every activation beside the loss's gradients; no bucket yet;
- an untied head's gradient, the first to arrive: the head's and the loss's saved tensors
  freed, the gradient of the head's input live and under stage 2 the head's own (alive
  until the hook that copies it returns), beside the head's bucket;
- each block's MLP backward (dense models), last block first, once its w2 has made its
  gradient: the activations and transients of single_moments' point, and the buckets;
- the lookup's backward, at the end: its gradient beside every bucket not yet retired. Under
  stage 2 the gradient is alive until the hook that copies it into its bucket returns, so
  after the last launch (its output too); under stage 1 autograd adds it into the bucket
  and frees it before the hook launches, so there are two points, before and after.

Measured with the rehearsal's tracker on llama-tiny at width 256 (4 blocks, one 32-token
sequence, zero2 over 4 ranks, the default 25 MB buckets: one bucket holds every parameter):
the peak is at the lookup's backward, 38.46 MiB, which the forward's moment (21.36 MiB,
the estimate before this module) missed by 44%.
"""

from __future__ import annotations

from torch import nn

from llm.config import Config
from llm.estimate.activations import FIRST_STAGE_TERMS, ActivationEstimate
from llm.estimate.single_moments import block_points, embedding_point
from llm.models import model_blocks
from llm.optim import OPTIMIZERS
from llm.parallel.zero.layout import Bucket, model_buckets
from llm.precision import PrecisionPolicy


def zero_buckets_backward(
    cfg: Config,
    model: nn.Module,
    policy: PrecisionPolicy,
    stream: PrecisionPolicy,
    acts: ActivationEstimate,
    forward: dict[str, int],
    world: int,
    loss_backward: int,
) -> dict[str, int] | None:
    """The rank's rows at the backward moment, from the forward's rows; None where the
    layout is not ZeRO-1 or -2 on its own (see the module's docstring)."""
    par = cfg.parallelism
    if par.name not in ("zero1", "zero2") or world == 1:
        return None
    if par.tp_size > 1 or par.pp_size > 1 or par.ep_size > 1:
        return None
    stage = int(par.name[-1])
    w, r = policy.working_dtype.itemsize, policy.reduce_dtype.itemsize
    align = OPTIMIZERS[cfg.optimizer.name].quant_block or 1
    buckets = model_buckets(model, stage, par.bucket_cap_mb, w, world, align=align)
    order, marks = _arrival_order(model)
    live = _live_after(buckets, order, stage, par.buckets_in_flight, w, r)
    persist = forward["grads"]
    points = [{**forward, "loss_backward": loss_backward}]
    head = model.output.weight
    if head.requires_grad and head is not model.tok_embeddings.weight:
        points.append(
            {**_head_point(cfg, stream, acts, forward, head, stage), "reduce_buckets": live[0]}
        )
    if model.args.moe is None:  # two points per block: before and after w2's gradient
        at = [m for mark in marks for m in (mark - 1, mark)]
        rows = block_points(cfg, model, stream, acts, forward, persist)
        for point, k in zip(rows, at, strict=True):
            points.append({**point, "reduce_buckets": live[k] if k >= 0 else 0})
    end = embedding_point(cfg, model, stream, acts, forward, persist)
    if stage == 2:  # the lookup's gradient outlives the hook that copies it and launches
        points.append({**end, "reduce_buckets": live[-1]})
    else:  # autograd adds it into the bucket and frees it before the hook launches
        points.append({**end, "reduce_buckets": live[-2] if len(live) > 1 else 0})
        launched = {k: v for k, v in end.items() if k != "embedding_backward"}
        points.append({**launched, "reduce_buckets": live[-1]})
    return max(points, key=lambda rows: sum(rows.values()))


def _head_point(cfg, stream, acts, forward: dict[str, int], head, stage: int) -> dict[str, int]:
    """The head's gradient arrived (an untied head's is the first): the head's input and the
    loss's tensors are freed, the final norm and the blocks keep theirs; the gradient of the
    head's input is live and, under stage 2, the head's own (until its hook returns)."""
    b, s, d = cfg.train.micro_batch_size, cfg.data.seq_len, head.shape[1]
    p = stream.param_dtype.itemsize
    freed = sum(v for k, v in acts.outside.items() if k not in FIRST_STAGE_TERMS)
    freed -= sum(v for k, v in acts.outside.items() if k.startswith("final_norm."))
    return {
        **forward,
        "activations": acts.total - freed,
        "head_backward": p * b * s * d + (p * head.numel() if stage == 2 else 0),
    }


def _arrival_order(model: nn.Module) -> tuple[list[nn.Parameter], list[int]]:
    """The trainable parameters in the order their gradients arrive, and for each block
    (last first) the position of its w2 weight in that order."""
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    blocks = model_blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    root = [p for p in trainable if id(p) not in in_blocks]
    order = [p for p in reversed(root) if id(p) not in lookups]
    marks = []
    for block in reversed(blocks):
        w2 = block.feed_forward.w2.weight if hasattr(block.feed_forward, "w2") else None
        first = [w2] if w2 is not None and w2.requires_grad else []
        rest = [p for p in reversed(list(block.parameters())) if p.requires_grad and p is not w2]
        marks.append(len(order) + len(first) - 1)
        order += first + rest
    order += [p for p in root if id(p) in lookups]
    return order, marks


def _live_after(
    buckets: list[Bucket], order: list[nn.Parameter], stage: int, in_flight: int, w: int, r: int
) -> list[int]:
    """The bytes the gradient buckets hold beyond the forward's rows once each parameter of
    ``order`` has delivered its gradient, as reducer.py launches and retires them."""
    trainable = [b for b in buckets if b.trainable]
    bucket_of = {id(s.param): b.index for b in trainable for s in b.slots}
    launch_order = sorted(trainable, key=lambda b: -b.index)
    arrived = dict.fromkeys(bucket_of.values(), 0)
    pending: list[Bucket] = []
    launched = 0
    live = []
    for param in order:
        arrived[bucket_of[id(param)]] += 1
        while launched < len(launch_order):
            b = launch_order[launched]
            if arrived[b.index] < len(b.slots):
                break
            if len(pending) >= max(1, in_flight):
                pending.pop(0)
            pending.append(b)
            launched += 1
        unlaunched = [b for b in launch_order[launched:] if arrived[b.index]]
        held = sum(r * b.shard + _payload(b, stage, w, r) for b in pending)
        if stage == 2:
            held += sum(r * b.padded for b in unlaunched)
        live.append(held)
    return live


def _payload(b: Bucket, stage: int, w: int, r: int) -> int:
    """A launched bucket's full-size tensor beyond the forward's rows: stage 2's gradient
    bucket itself, stage 1's copy in the reduce dtype (none when it is the working one)."""
    if stage == 2:
        return r * b.padded
    return r * b.padded if r != w else 0
