"""Tensor (and sequence) parallelism with torch's DTensor styles, Megatron's split:

- attention: wq/wk/wv column-parallel (each rank computes n_heads/tp query heads and
  n_kv_heads/tp key/value heads), wo row-parallel; MLP: w1 (and w3) column, w2 row. With
  fewer key/value heads than tp ranks (tp a multiple of n_kv_heads), wk and wv are
  replicated instead and each rank keeps the one kv head its query heads share
  (``ReplicatedKV``). One
  all-reduce of the (B, T, d) activations after each row-parallel layer in forward, one
  before each block's column-parallel layers in backward.
- token embedding vocab-parallel (row-parallel nn.Embedding), LM head column-parallel with
  its logits left vocab-sharded: the loss runs under ``loss_parallel()`` and never gathers
  them. A tied LM head shares the embedding's (V, d) DTensor: both shard dim 0 alike.
- replicated on every tp rank: norms, biases of row-parallel layers, GPT-2's position table.
- ``sequence_parallel``: norms and dropouts run on (B, T/tp, d) sequence shards; the
  all-reduces become an all-gather before the column split and a reduce-scatter after the
  row split (same bytes, 1/tp of the norm activations held).
- dropout: where a rank's activation is its own (its attention heads; its sequence shard
  under SP) masks come from a tp-rank stream, elsewhere from the stream all tp ranks share
  (llm.parallel.tp_rng).

Applied to the model on the meta device, before recompute, compile and data-parallel
wrapping; materialisation then fills each rank's DTensor shards (llm.models.weights).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from llm.errors import ConfigError
from llm.models.args import ModelArgs
from llm.parallel.tp_rng import RankStream, use_rank_streams

__all__ = [
    "align_grads",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "kv_heads_placeable",
    "kv_replicated",
    "local_kv_heads",
    "local_loss",
    "local_tensor",
    "loss_parallel",
    "padded_vocab",
    "tp_copies",
    "tp_local_shapes",
]


def padded_vocab(vocab_size: int, tp_size: int, multiple: int = 1) -> int:
    """Megatron's make-vocab-size-divisible-by: the next multiple of ``multiple`` x tp
    (model.vocab_multiple, tensor parallel's shards). The extra rows are never tokens: the
    model gives their logits -inf (ModelArgs.true_vocab_size), so they take no probability,
    no gradient and are never sampled."""
    step = multiple * tp_size
    return -(-vocab_size // step) * step


def check_tensor_parallel(args: ModelArgs, tp_size: int, seq_len: int, sp: bool) -> None:
    """What the Megatron split needs of a shape, refused in one line before ranks start."""
    if tp_size == 1:
        return
    for name, value in (
        ("n_heads", args.n_heads),
        ("d_model", args.d_model),
        ("d_ff", args.d_ff),
    ):
        if value % tp_size:
            raise ConfigError(
                f"model.{name}={value} is not divisible by parallelism.tp_size={tp_size}; "
                f"pick a tp_size that divides it"
            )
    if not kv_heads_placeable(args.n_kv_heads, tp_size):
        raise ConfigError(
            f"model.n_kv_heads={args.n_kv_heads} and parallelism.tp_size={tp_size}: key/value "
            "heads are split when tp divides them and replicated when tp is a multiple of "
            "them, and neither holds; pick a tp_size that divides n_kv_heads or is a "
            "multiple of it"
        )
    if sp and seq_len % tp_size:
        raise ConfigError(
            f"data.seq_len={seq_len} is not divisible by parallelism.tp_size={tp_size}, which "
            "parallelism.sequence_parallel=true shards; change data.seq_len or tp_size"
        )


def kv_heads_placeable(n_kv_heads: int, tp_size: int) -> bool:
    """Whether tensor parallel can place the key/value heads: split (tp divides them) or
    replicated (tp a multiple of them: Megatron's and vLLM's rule)."""
    return n_kv_heads % tp_size == 0 or tp_size % n_kv_heads == 0


def kv_replicated(n_kv_heads: int, tp_size: int) -> bool:
    """Whether tensor parallel replicates the key/value heads rather than splitting them
    (for placeable heads: fewer of them than tp ranks)."""
    return n_kv_heads % tp_size != 0


def local_kv_heads(n_kv_heads: int, tp_size: int) -> int:
    """Key/value heads one tp rank computes attention with: its share, or the one kv head
    its query heads share when they are replicated."""
    return 1 if kv_replicated(n_kv_heads, tp_size) else n_kv_heads // tp_size


class ReplicatedKV(ParallelStyle):
    """wk or wv whole on every tp rank (a Replicate DTensor), its output cut to the one kv
    head this rank's query heads use: rank r of tp keeps head r // (tp / n_kv_heads).

    The cut is taken from a local tensor whose gradient is declared ``Partial``: each rank
    back-propagates through its own head only, so the input's gradient joins the query
    projection's partial sum (one all-reduce per block, as before) and the weight's gradient
    is summed over tp like a sequence-parallel norm gain's (align_grads and the data-parallel
    strategies redistribute it to Replicate). Costs against a split: the whole wk/wv on
    every rank (2·d·n_kv·head_dim parameters, gradients and optimizer states per block, not
    1/tp of them), all kv heads computed in forward, and that gradient all-reduce."""

    def __init__(self, n_kv_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        head = tp_rank // (tp_size // n_kv_heads)
        self.columns = slice(head * head_dim, (head + 1) * head_dim)

    def _local_head(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local(grad_placements=(Partial(),))[..., self.columns]  # (B, T, D)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # No partition_fn: distribute_module replicates every parameter.
        return distribute_module(module, device_mesh, output_fn=self._local_head)


def _kv_style(args: ModelArgs, tp_rank: int, tp_size: int) -> ParallelStyle:
    if kv_replicated(args.n_kv_heads, tp_size):
        return ReplicatedKV(args.n_kv_heads, args.head_dim, tp_rank, tp_size)
    return ColwiseParallel()


def _block_plan(args: ModelArgs, sp: bool, tp_rank: int, tp_size: int) -> dict:
    """Styles for one Block's submodules. The attention and MLP inputs become one DTensor
    (PrepareModuleInput, use_local_output=False), so the gradients of wq, wk and wv (w1, w3)
    add up as partial sums before ONE all-reduce (reduce-scatter under SP) in backward."""
    seq, rep = Shard(1), Replicate()
    inner = seq if sp else rep
    plan = {
        "attention": PrepareModuleInput(
            input_layouts=(inner, None, None), desired_input_layouts=(rep, None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": _kv_style(args, tp_rank, tp_size),
        "attention.wv": _kv_style(args, tp_rank, tp_size),
        "attention.wo": RowwiseParallel(output_layouts=inner),
        "feed_forward": PrepareModuleInput(input_layouts=(inner,), desired_input_layouts=(rep,)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=inner),
    }
    if args.family == "llama":
        plan["feed_forward.w3"] = ColwiseParallel()
    if sp:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan


def _root_plan(model: nn.Module, sp: bool) -> dict:
    """Styles for the modules outside the blocks: embeddings, final norm, head."""
    residual = Shard(1) if sp else Replicate()
    plan = {
        # Vocab-parallel embedding: each rank looks up its rows, the partial sums meet in an
        # all-reduce (reduce-scatter onto sequence shards under SP).
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(
            input_layouts=residual, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sp:
        plan["norm"] = SequenceParallel()
        # The replicated (T, d) or (B, T, d) position rows, cut to this rank's sequence
        # shard (dim -2 in both); backward all-gathers its gradient, equal on every rank.
        plan["pos_embeddings"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(-2)
        )
    # Only the modules the model has: llama has no position table, and a pipeline stage's
    # part holds some of them only.
    return {name: style for name, style in plan.items() if hasattr(model, name)}


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    """Split ``model`` (a llm.models.Transformer, on any device, meta included) over the 1-D
    tp ``mesh``; every Attention then computes its local heads."""
    tp = mesh.size()
    sp = sequence_parallel
    parallelize_module(model, mesh, _root_plan(model, sp))
    layers = model.layers
    blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
    args, rank = model.args, mesh.get_local_rank()
    for block in blocks:
        parallelize_module(block, mesh, _block_plan(args, sp, rank, tp))
        block.attention.n_heads //= tp
        block.attention.n_kv_heads = local_kv_heads(args.n_kv_heads, tp)
    use_rank_streams(model, blocks, RankStream(rank, tp, mesh.device_type), sp)
    model.tie_weights()  # the head's parameter was replaced: share the embedding's again
    return model


def _split_dims(style, module: nn.Module) -> dict[str, int]:
    """Which of ``module``'s parameters ``style`` shards, and on which dim (torch's rules:
    column-parallel shards a Linear's output features, weight and bias, and an Embedding's
    columns; row-parallel a Linear's input features, its bias replicated, and an
    Embedding's rows). Other styles (ReplicatedKV's whole weights included) split none."""
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return {"weight": 1} if embedding else {"weight": 0, "bias": 0}
    if isinstance(style, RowwiseParallel):
        return {"weight": 0} if embedding else {"weight": 1}
    return {}


def tp_local_shapes(model: nn.Module, tp_size: int, tp_rank: int) -> dict[nn.Parameter, torch.Size]:
    """Each parameter's local shape on tp rank ``tp_rank`` under apply_tensor_parallel's
    split, read off the plan and the module types alone (a plain meta model, no mesh: what
    llm.estimate sizes). A sharded dim is cut as DTensor cuts it (ceil(n / tp) per rank, the
    last ones shorter); a tied head shares the embedding's parameter and its split."""
    shapes = {p: p.shape for p in model.parameters()}
    if tp_size == 1:
        return shapes
    plan = _root_plan(model, sp=False)  # sequence parallel splits no other parameter
    # Blocks by their names: a pipeline part keys its blocks by their whole-model index.
    block_plan = _block_plan(model.args, sp=False, tp_rank=tp_rank, tp_size=tp_size)
    for i, _ in model.layers.named_children():
        plan |= {f"layers.{i}.{k}": v for k, v in block_plan.items()}
    for fqn, style in plan.items():
        module = model.get_submodule(fqn)
        for name, dim in _split_dims(style, module).items():
            param = getattr(module, name, None)
            if param is not None:
                size = param.shape[dim]
                chunk = -(-size // tp_size)
                local = max(0, min(chunk, size - tp_rank * chunk))
                shapes[param] = torch.Size((*param.shape[:dim], local, *param.shape[dim + 1 :]))
    return shapes


def tp_copies(param: torch.Tensor, tp_size: int) -> int:
    """On how many tp ranks ``param``'s elements repeat: 1 when tensor parallel shards it,
    tp_size when every tp rank holds it whole (a plain tensor, or Replicate on the tp
    dimension of its mesh, FSDP's 2-D mesh included)."""
    if tp_size == 1:
        return 1
    if not isinstance(param, DTensor):
        return tp_size
    names = param.device_mesh.mesh_dim_names or ()
    if "tp" not in names:  # FSDP's 1-D dp mesh on a parameter tensor parallel left whole
        return tp_size
    return 1 if param.placements[names.index("tp")].is_shard() else tp_size


@torch.no_grad()
def align_grads(model: nn.Module) -> None:
    """Give every DTensor gradient its parameter's placements, so that its local shard is
    what the norm, clipping and the optimizer read. DTensor's autograd may leave other
    ones: a ``Partial`` sum for the gains of norms under sequence parallel (each rank saw
    only its sequence shard: one all-reduce per gain, as Megatron all-reduces layer-norm
    gradients over the tensor-parallel group), or a ``Replicate`` whole gradient for the
    vocab-parallel embedding (its backward scatters into the whole table; taking this
    rank's rows is local)."""
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (a DTensor's local shard, else ``t``); in-place ops
    on it change the DTensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor: ``loss_parallel``'s sum is a Replicate DTensor, equal on
    every tp rank; ``to_local`` is differentiable, so backward runs through it."""
    return loss.to_local() if isinstance(loss, DTensor) else loss
