"""Element-wise optimizer steps in cache-sized batches of tensor pieces.

A ``torch._foreach_*`` op over a whole param group makes one full-size temporary per
intermediate and reads every tensor from memory once per op: on a GPU that is what fused
multi-tensor kernels are for, but on a CPU a LAMB step of gpt2-small then streams about 15
passes over 124M elements through memory. Cutting the group's tensors into flat pieces and
running the same ``_foreach`` ops on a batch of pieces at a time keeps a batch's
intermediates in cache, so memory sees each state tensor read and written once, and the
temporaries are batch-sized instead of model-sized (benchmarks/optimizers.py measures both).

The results are element for element those of the whole-tensor ops: only which elements an op
sees at once changes, never the arithmetic per element.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Elements per batch on a CPU, measured (docs/benchmarks.md, gpt2-small on 2 EPYC cores):
# LAMB's step took 698, 555, 533, 597, 804 and 1432 ms at 2^16, 2^17, 2^18, 2^19, 2^20 and
# whole groups. At 2^18 a batch of LAMB's four state rows and its temporaries (1 MiB each in
# fp32) sits in L3; smaller batches pay Python's per-op overhead, larger ones spill to memory.
# A GPU takes each group as one batch (its foreach kernels fuse across tensors).
CPU_BATCH_ELEMENTS = 1 << 18


def batch_elements(device: torch.device) -> int | None:
    return CPU_BATCH_ELEMENTS if device.type == "cpu" else None


def pieces(
    rows: list[list[torch.Tensor]], limit: int | None
) -> Iterator[tuple[list[list[torch.Tensor]], list[int]]]:
    """Batches of pieces of ``rows`` (lists aligned tensor by tensor: params, grads, states),
    at most ``limit`` elements per batch, with the index of the tensor each piece comes from.
    A tensor larger than ``limit`` is split into flat views; a non-contiguous one (which no
    flat view can cover) stays whole; ``limit=None`` yields all tensors as one batch."""
    count = len(rows[0])
    if limit is None:
        if count:
            yield rows, list(range(count))
        return
    batch: list[list[torch.Tensor]] = [[] for _ in rows]
    owners: list[int] = []
    size = 0
    for i in range(count):
        tensors = [row[i] for row in rows]
        n = tensors[0].numel()
        if n > limit and all(t.is_contiguous() for t in tensors):
            flat = [t.view(-1) for t in tensors]
            spans = [(a, min(a + limit, n)) for a in range(0, n, limit)]
        else:
            flat, spans = tensors, [None]
        for span in spans:
            part = flat if span is None else [t[span[0] : span[1]] for t in flat]
            if size and size + part[0].numel() > limit:
                yield batch, owners
                batch, owners, size = [[] for _ in rows], [], 0
            for j, t in enumerate(part):
                batch[j].append(t)
            owners.append(i)
            size += part[0].numel()
    if owners:
        yield batch, owners
