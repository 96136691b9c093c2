"""Parameters FSDP2 holds gathered while autograd saves them: under ``parallelism=fsdp``, and
under ``parallelism=ddp`` beside tensor or pipeline parallel (torch's ``replicate``, FSDP2's
machinery). The gathered parameter is a storage of its own, not the shard the strategy lists
as model state, so it is memory beside the model states; the peak tracker counts it with
the activations, since autograd saved it.

Which weights an op saves: a linear's (its input's gradient needs it), a norm's gain and
bias; not an embedding's (a lookup saves the indices) nor a linear's bias.

When they are held, measured on gpt2-tiny and llama-tiny (docs/parallel.md):
- replicate, and fsdp with ``reshard_after_forward=false``: nothing is resharded, so every
  saved weight of the root (or pipeline stage) stays gathered;
- fsdp: the root (embeddings, final norm, head) stays gathered through forward; the blocks
  are resharded, and the first backward gathers the last block again while every
  in-flight micro-batch is still held. On a stage with the head, the backward of the final
  norm, head and loss first frees their tensors and the root's gathered weights (FSDP2
  reshards a group once its gradients are done), so the peak is the larger of the root's
  weights before backward and what the block adds beyond the freed tensors.
"""

from __future__ import annotations

from torch import nn

from llm.config import ParallelismConfig
from llm.models import model_blocks
from llm.models.layers import RMSNorm


def saved_weight_bytes(module: nn.Module, shapes: dict, itemsize: int) -> int:
    """Bytes of the weights ``module``'s own ops save (its blocks' excluded when ``module``
    is a root), at the local shapes ``shapes`` (tensor parallel's)."""
    inside = {id(p) for block in model_blocks(module) for p in block.parameters()}
    seen, n = set(), 0
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            held = [sub.weight]
        elif isinstance(sub, nn.LayerNorm | RMSNorm):
            held = [p for p in (sub.weight, getattr(sub, "bias", None)) if p is not None]
        else:
            continue
        for p in held:
            if id(p) not in inside and id(p) not in seen:  # a tied weight once
                seen.add(id(p))
                n += shapes[p].numel() * itemsize
    return n


def gathered_saved_bytes(
    roots: list[nn.Module],
    par: ParallelismConfig,
    shapes: dict,
    itemsize: int,
    freed_first: list[int],
) -> int:
    """Gathered weights autograd holds at the activation peak of a rank whose roots (the
    model, or its pipeline stages) are ``roots``; ``freed_first``: per root, the bytes one
    micro-batch's final norm, head and loss save, freed before the first backward gathers a
    block again (0 on a stage without the head). A rank with two stages (V-shaped) counts both stages' last
    blocks: an upper bound, not measured."""
    fsdp2 = par.name == "fsdp" or (par.name == "ddp" and (par.tp_size > 1 or par.pp_size > 1))
    if not fsdp2:
        return 0
    resharded = par.name == "fsdp" and par.reshard_after_forward
    total = 0
    for root, freed in zip(roots, freed_first, strict=True):
        blocks = [saved_weight_bytes(b, shapes, itemsize) for b in model_blocks(root)]
        own = saved_weight_bytes(root, shapes, itemsize)
        if not resharded:
            total += own + sum(blocks)
        elif freed:  # the stage with the head
            total += max(own, blocks[-1] - freed if blocks else 0)
        else:
            total += own + (blocks[-1] if blocks else 0)
    return total
