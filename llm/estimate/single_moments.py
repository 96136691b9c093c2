"""The three moments of a replica's step (``parallelism=single`` on one device, and
``parallelism=ddp`` without tensor, pipeline or expert parallel), where its live bytes are
counted (docs/recompute.md, "The memory estimator"); the total is the largest. Measured
with the peak tracker on CPU (tests/test_estimate_single_moments.py):

- forward: the end of forward. Parameters, optimizer states and every saved activation
  (under ``train.fused_loss=chunked`` with the loss's working tensors, ``loss_forward``);
  no gradient on one device (the Trainer zeroes them to None after each step) unless
  ``train.grad_accum_steps > 1``, where every gradient exists from the second micro-batch.
  Under ddp every gradient exists throughout: they are views of DDP's buckets
  (``gradient_as_bucket_view``), which persist; a new gradient is copied into its bucket
  and freed, as an accumulated one is added and freed.
- backward: the largest of these points, each named by its rows.
  - The loss's backward (``loss_backward``): every activation still saved, and beside the
    log-softmax it saved two fp32 tensors of the logits' size (nll_loss's gradient and
    log_softmax's).
  - Each block's MLP backward (``mlp_backward``, ``weight_grads_made``), last block first,
    at two points: during w2's backward (its input still saved; the gradient of that input,
    the residual stream's, which is w2's output gradient, and w2's new weight gradient
    live) and after it. The outside terms
    (final norm, head input, log-softmax) are freed, the blocks after it too, and so is
    w2's saved input once w2's backward ran; the gradients of the MLP's intermediates are
    then live (SwiGLU: w2's input, silu's output and w3's output at once;
    GELU: w2's input and the GELU's input), beside the residual stream's gradient and the
    weight gradients made so far (head, final norm, later blocks, w2; where gradients
    persist none is new, except a tied head's, which waits for the lookup's). Under full
    recompute and op_sac the block is recomputed whole by then, so it holds every tensor a
    block saves (op_sac: and the w2 output its cache keeps, which the recompute never
    reaches). Going down frees a block's activations and adds its weight gradients, so
    without recompute the last block is the larger and under full recompute the first.
  - The lookup's backward at the end (``embedding_backward``): every gradient, the
    embedding output's gradient and a tied head's waiting for the lookup's (where
    gradients persist, the lookup's new one too).
- optimizer_step: parameters, gradients, states and the optimizer's temporaries. torch's
  fused AdamW makes none; its foreach AdamW (``optimizer.fused=false`` on CUDA) one tensor
  of each parameter's size per param group (``_foreach_sqrt`` of exp_avg_sq); its for-loop
  (``optimizer.fused=false`` on CPU) a parameter's ``sqrt`` and its quotient while the
  previous parameter's quotient is still referenced. Other optimizers' temporaries are not
  counted.

Weight gradients are in the parameter dtype (fp32 under autocast), the loss's in fp32 (the
Trainer upcasts the logits: llm/train/trainer.py ``_cross_entropy_sum``), the MLP's in the
compute dtype. ``train.fused_loss`` never holds the logits: its loss's backward point holds
the gradients the fused op makes beside what it kept (``llm.estimate.activations.
fused_loss_terms``). MoE blocks and every other layout keep their rows as before
(llm.estimate.backward_peak for sharded ones). Under ddp, the comm hook's copy of a bucket
in another reduce dtype is not counted (it is made only when the reduce dtype differs from
the gradients').
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from llm.config import Config
from llm.estimate.activations import F32, ActivationEstimate, outside_by_stage
from llm.models import model_blocks
from llm.optim import optimizer_param_groups
from llm.precision import PrecisionPolicy

# Gradients of the MLP's intermediates live at once in its backward, by model family.
MLP_GRADS = {"llama": 3, "gpt2": 2}
# Policies under which a block is recomputed whole before its backward (offload: brought
# back; not measured), so it holds every tensor a block saves (``layer_none``).
WHOLE_AGAIN = ("full", "op_sac", "offload")


@dataclass
class Moments:
    """The rows at each moment of the step (name -> bytes)."""

    forward: dict[str, int]
    backward: dict[str, int]
    optimizer_step: dict[str, int]


def single_moments(
    cfg: Config,
    model: nn.Module,
    policy: PrecisionPolicy,
    acts: ActivationEstimate,
    states: dict[str, int],
    world: int,
) -> Moments | None:
    """The moments of a replica's step from its model ``states`` (params, grads,
    optimizer_states as a step leaves them) and ``acts``; None where this module has no
    model of them (see the module's docstring)."""
    if not _replica(cfg, model, world):
        return None
    args = model.args
    ddp = cfg.parallelism.name == "ddp"
    persist = states["grads"] if ddp or cfg.train.grad_accum_steps > 1 else 0
    saved = {**_states(states, persist), "activations": acts.total}
    b, s = cfg.train.micro_batch_size, cfg.data.seq_len
    forward = dict(saved)
    if cfg.train.fused_loss == "chunked":  # the forward's peak is in the loss, its last op
        forward["loss_forward"] = _chunked_loss_working(cfg, b * s, args, policy)
    points = block_points(cfg, model, policy, acts, states, persist)
    points.append({**saved, "loss_backward": loss_backward_bytes(cfg, args, policy, b)})
    points.append(embedding_point(cfg, model, policy, acts, states, persist))
    backward = max(points, key=lambda rows: sum(rows.values()))
    step = _states(states, states["grads"])
    step["optimizer_temporaries"] = optimizer_temporaries(cfg, model, policy)
    return Moments(forward, backward, step)


def _chunked_loss_working(cfg: Config, n: int, args, policy: PrecisionPolicy) -> int:
    """The chunked loss's working tensors at their most, beside the gradients it keeps
    (llm/train/loss.py ``_chunks``; the gradients count as activations here, where they
    are saved): the head weight cast to the compute dtype under autocast, and the largest
    of three points of a chunk of ``rows`` tokens. logsumexp: the fp32 logits and
    logsumexp's own copy of them (ATen subtracts the maximum into a new tensor). The
    cast: the compute dtype's logits beside their fp32 copy. The weight gradient: the fp32
    logits (turned into the softmax gradient in place), that gradient in the compute
    dtype, the chunk's (V, d) weight gradient in the compute dtype and its fp32 copy.
    Liger's and cut-cross-entropy's working tensors are not counted."""
    d, v = args.d_model, args.vocab_size
    c = policy.compute_dtype.itemsize
    rows = min(cfg.train.fused_loss_chunk, n)
    weight = v * d * c if policy.compute_dtype != policy.param_dtype else 0
    cast = c != F32
    logsumexp = 2 * rows * v * F32
    upcast = rows * v * (c + F32) if cast else 0
    weight_grad = rows * v * (F32 + (c if cast else 0)) + v * d * (c + (F32 if cast else 0))
    return weight + max(logsumexp, upcast, weight_grad)


def loss_backward_bytes(cfg: Config, args, policy: PrecisionPolicy, batch: int) -> int:
    """What the loss's backward makes for ``batch`` sequences while every activation is
    still saved: nll_loss's and log_softmax's gradients, fp32 tensors of the logits' size;
    under tensor parallel (torch's ``loss_parallel``, over 1/tp of the vocabulary) three
    such tensors, as the peak tracker measures its handlers' backward on CPU; or the fused
    loss's gradients."""
    s, tp = cfg.data.seq_len, cfg.parallelism.tp_size
    if cfg.train.fused_loss == "off":
        return (2 if tp == 1 else 3) * batch * s * -(-args.vocab_size // tp) * F32
    return _fused_loss_grads(cfg.train.fused_loss, batch * s, args, policy)


def _fused_loss_grads(name: str, n: int, args, policy: PrecisionPolicy) -> int:
    """What the fused loss's backward makes while it still holds what it saved: chunked
    scales its kept gradients into new ones, (n, d) in the stream's dtype and (V, d) in
    fp32 cast to the weight's dtype (a second tensor unless that is fp32); Liger-Kernel and
    cut-cross-entropy make theirs in the compute dtype (from their sources, not measured)."""
    d, v = args.d_model, args.vocab_size
    p, c = policy.param_dtype.itemsize, policy.compute_dtype.itemsize
    if name == "chunked":
        return n * d * p + v * d * F32 + (v * d * p if p != F32 else 0)
    return (n + v) * d * c


def _replica(cfg: Config, model: nn.Module, world: int) -> bool:
    """One device, or ddp's whole replicas of a dense model."""
    par, args = cfg.parallelism, getattr(model, "args", None)
    if args is None or args.moe is not None:
        return False
    if par.name == "single":
        return world == 1
    return par.name == "ddp" and par.tp_size == par.pp_size == par.ep_size == 1


def _states(states: dict[str, int], grads: int) -> dict[str, int]:
    """The model-state rows with ``grads`` bytes of gradients."""
    return {
        "params": states["params"],
        "grads": grads,
        "optimizer_states": states["optimizer_states"],
    }


def block_points(cfg, model, policy, acts, states, persist: int) -> list[dict[str, int]]:
    """Two points of each block's MLP backward, last block first: during w2's backward (its
    input still saved, the gradient of that input and w2's weight gradient made beside the
    residual stream's) and after it (w2's input freed, the MLP's intermediate gradients
    live). The blocks before it keep what they saved, the block itself what it saved (or,
    recomputed, every tensor a block saves); the blocks after it are freed and have made
    their weight gradients."""
    args, blocks = model.args, model_blocks(model)
    b, s = cfg.train.micro_batch_size, cfg.data.seq_len
    p, c = policy.param_dtype.itemsize, policy.compute_dtype.itemsize
    whole = sum(acts.layer_none.values())
    # op_sac's cached w2 output: the recompute stops before w2 (nothing saves its output),
    # so the cache keeps it until the block's backward ends
    unreached = acts.layer.get("w2.output", 0) if cfg.recompute.name.startswith("op_sac") else 0
    kept = [acts.block(i) for i in range(len(blocks))]
    lookups = outside_by_stage(acts.outside)[0]
    w2_input = acts.layer_none.get("mlp.w2_input", 0)
    stream = b * s * args.d_model * p
    during = b * s * args.d_ff * c + stream  # w2's output gradient is the stream's
    after = MLP_GRADS[args.family] * b * s * args.d_ff * c + stream
    tied = _tied_head(model)
    made = _trainable(model.output, model.norm)  # the head's and the final norm's
    points = []
    for i in reversed(range(len(blocks))):
        again = whole + unreached if cfg.recompute.name in WHOLE_AGAIN else kept[i]
        saved = lookups + sum(kept[:i]) + again
        # Where gradients persist (accumulation, ddp's buckets) each new one is added or
        # copied into its gradient and freed, except the tied head's, which waits for the
        # lookup's at the end of backward.
        w2 = _trainable(blocks[i].feed_forward.w2)
        new = tied if persist else made + w2
        # during w2's backward its weight gradient is new even where gradients persist
        for held, transient, grads in (
            (saved, during, new + w2 if persist else new),
            (saved - w2_input, after, new),
        ):
            points.append(
                {
                    **_states(states, persist),
                    "activations": held,
                    "mlp_backward": transient,
                    "weight_grads_made": p * grads,
                }
            )
        made += _trainable(blocks[i])
    return points


def embedding_point(cfg, model, policy, acts, states, persist: int) -> dict[str, int]:
    """The end of backward, at the lookup's: every gradient, the embedding output's gradient,
    a tied head's gradient waiting for the lookup's and, where gradients persist, the
    lookup's new one."""
    b, s, d = cfg.train.micro_batch_size, cfg.data.seq_len, model.args.d_model
    p = policy.param_dtype.itemsize
    tied = _tied_head(model)
    lookup = _trainable(model.tok_embeddings) if persist else 0
    return {
        **_states(states, states["grads"]),
        "activations": outside_by_stage(acts.outside)[0],
        "embedding_backward": p * (b * s * d + tied + lookup),
    }


def _trainable(*modules: nn.Module) -> int:
    return sum(x.numel() for m in modules for x in m.parameters() if x.requires_grad)


def _tied_head(model: nn.Module) -> int:
    """Elements of the head's gradient when the head is tied to the embedding (it waits as a
    tensor of its own until the lookup's arrives), else 0."""
    head = model.output.weight
    return head.numel() if head is model.tok_embeddings.weight and head.requires_grad else 0


def optimizer_temporaries(cfg: Config, model: nn.Module, policy: PrecisionPolicy) -> int:
    """Bytes torch's AdamW allocates during its step beyond its states (module docstring);
    0 for the fused kernel and for other optimizers."""
    opt = cfg.optimizer
    if opt.name != "adamw" or opt.fused is not False:
        return 0
    itemsize = policy.param_dtype.itemsize  # exp_avg_sq has its parameter's dtype
    groups = [
        [x for x in g["params"] if x.requires_grad] for g in optimizer_param_groups(model, opt)
    ]
    if cfg.estimate.kernels == "cuda":  # foreach: the whole group's square roots at once
        return itemsize * max((sum(x.numel() for x in g) for g in groups), default=0)
    # for-loop: a parameter's square root and quotient while the previous one's quotient
    # (its ``denom``) is still referenced
    sizes = [[x.numel() for x in g] for g in groups]
    pairs = [before + 2 * n for g in sizes for before, n in zip([0, *g], g, strict=False)]
    return itemsize * max(pairs, default=0)
