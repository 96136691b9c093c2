"""The overflow-checked optimizer step every strategy on torch collectives shares.

One all-reduce of the squared gradient norm finds both the clipping norm and overflow: an
inf or nan on any rank or shard makes the sum non-finite everywhere, so every rank skips the
same step without a second collective. Then unscale and clip in one pass, step, and update
the loss scaler. A strategy composes this function with what it knows: which gradients it
holds, how many ranks hold each element, and how to step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llm.dist import gather_object
from llm.errors import TrainingError
from llm.precision import LossScaler


@dataclass
class StepResult:
    grad_norm: float  # the global L2 norm before clipping
    skipped: bool = False  # True when the step was not applied (overflow)
    loss_scale: float = 1.0


def global_grad_norm(
    grads: list[torch.Tensor],
    device: torch.device,
    grad_replicas: int,
    group: dist.ProcessGroup | None = None,
) -> float:
    """L2 norm over every rank's gradients. ``grad_replicas``: how many ranks hold each
    element (the world size for replicas, 1 when gradients are sharded)."""
    if grads:
        sq = torch.stack(torch._foreach_norm(grads, 2.0)).float().pow(2).sum()
    else:
        sq = torch.zeros((), device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        # The sum goes over the communication device: NCCL takes no CPU tensor (an offloaded
        # optimizer's gradients live on the host).
        sq = sq.to(device)
        dist.all_reduce(sq, group=group)
        sq = sq / grad_replicas
    return math.sqrt(float(sq))


def overflow_checked_step(
    grads: list[torch.Tensor],
    max_norm: float,
    scaler: LossScaler,
    step: Callable[[], None],
    nonfinite_names: Callable[[], list[str]],
    device: torch.device,
    grad_replicas: int,
    group: dist.ProcessGroup | None = None,
) -> StepResult:
    """Skip the step on overflow, else unscale + clip ``grads`` in place and ``step()``."""
    scale = scaler.scale
    norm = global_grad_norm(grads, device, grad_replicas, group)  # of the scaled gradients
    if not math.isfinite(norm):
        scaler.update(found_inf=True)
        if scaler.gave_up:
            raise _overflow_error(scaler, nonfinite_names())
        return StepResult(grad_norm=norm, skipped=True, loss_scale=scale)
    norm /= scale
    # g <- g / scale * min(1, max_norm / ||g / scale||), one pass over the gradients.
    clip = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
    if grads and clip / scale != 1.0:
        torch._foreach_mul_(grads, clip / scale)
    step()
    scaler.update(found_inf=False)
    return StepResult(grad_norm=norm, loss_scale=scale)


def _overflow_error(scaler: LossScaler, local_names: list[str]) -> TrainingError:
    names = sorted({n for rank in gather_object(local_names) for n in rank})
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return TrainingError(
        f"gradients overflowed {scaler.overflows_at_min_scale} steps in a row at "
        f"loss scale {scaler.scale:g} (its minimum) in: {shown}; lower the "
        "learning rate, use precision=bf16, or check the data for extreme values"
    )
