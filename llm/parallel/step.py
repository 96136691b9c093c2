"""The overflow-checked optimizer step every strategy on torch collectives shares.

One all-reduce of the squared gradient norm finds both the clipping norm and overflow: an
inf or nan on any rank or shard makes the sum non-finite everywhere, so every rank skips the
same step without a second collective. Where every rank already holds the same gradients
(DDP, whose all-reduce made them so) the local norm is the global one and no collective is
issued. Then unscale and clip in one pass (the clip
coefficient a device tensor), step, and update the loss scaler. Where the optimizer can skip
a step on the device (torch's fused AdamW, given ``found_inf`` as GradScaler gives it) the
step reads nothing on the host; elsewhere it reads one value, whether the norm is finite
(``overflow_checked_step`` says why). A strategy composes this function with what it knows:
which gradients it holds, how many ranks hold each element, and how to step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental import implicit_replication

from llm.errors import TrainingError
from llm.optim import RoundedUpdate
from llm.parallel.dist import gather_object
from llm.precision import LossScaler


@dataclass
class StepResult:
    # The global L2 norm before clipping: a 0-d tensor on the step's device from the
    # overflow-checked step (the Trainer reads it on logged steps only), a float from
    # DeepSpeed's engine.
    grad_norm: torch.Tensor | float
    # Whether the step was not applied (overflow): a bool where the host decided, a 0-d bool
    # tensor on the device where the optimizer skipped it there (``skips_on_device``); the
    # Trainer reads that with the step's other values and then calls ``settle_skip``.
    skipped: bool | torch.Tensor = False
    loss_scale: float = 1.0


# Elements per piece of a gradient whose norm is taken alone: torch's fp32 norm of one large
# CPU tensor reads low (-2.7e-3 relative at gpt2-small's 38.6M-element embedding gradient,
# -5e-4 at 4M), so a rank that holds a whole tensor (single, ddp) and one that holds a shard
# (ZeRO, FSDP) would log different norms and clip by different factors. Pieces of 64Ki
# elements read within 1e-6 (tests/test_grad_norm.py).
NORM_PIECE = 1 << 16


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of ``grads``, fp64: torch's get_total_norm over pieces of at most
    NORM_PIECE elements (views, no copy), squared in fp64 so the sum over ranks is exact to
    the last fp32 digit. fp32 before squaring: a 16-bit norm squared overflows fp16."""
    pieces = [piece for g in grads for piece in g.reshape(-1).split(NORM_PIECE)]
    return torch.nn.utils.get_total_norm(pieces, norm_type=2.0).double().pow(2)


def global_grad_norm(
    grads: list[torch.Tensor],
    device: torch.device,
    grad_replicas: int | list[int],
    group: dist.ProcessGroup | None = None,
    same_on_every_rank: bool = False,
) -> torch.Tensor:
    """L2 norm over every rank's gradients, a 0-d fp32 tensor on ``device``, not read on the
    host. ``grad_replicas``: how many ranks hold each element (the world size for replicas,
    1 when gradients are sharded), one number for all, or one per gradient (tensor parallel
    replicates norms and biases on its ranks but splits the matrices), so that no element
    is counted twice. ``same_on_every_rank``: every rank holds the same gradients (DDP after
    its all-reduce), so this rank's norm is the global one and no collective is issued; the
    caller decides it from the strategy, never per rank, so all ranks skip it together."""
    if same_on_every_rank:
        return _squared_norm(grads).sqrt().float() if grads else torch.zeros((), device=device)
    if not grads:
        sq = torch.zeros((), device=device, dtype=torch.float64)
    elif isinstance(grad_replicas, int):
        sq = _squared_norm(grads)
    else:  # one sum per replica count (a few), each divided by its count
        sq = sum(
            _squared_norm([g for g, r in zip(grads, grad_replicas, strict=True) if r == count])
            / count
            for count in sorted(set(grad_replicas))
        )
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        # The sum goes over the communication device: NCCL takes no CPU tensor (an offloaded
        # optimizer's gradients live on the host).
        sq = sq.to(device)
        dist.all_reduce(sq, group=group)
        if isinstance(grad_replicas, int):
            sq = sq / grad_replicas
    return sq.sqrt().float()


def skips_on_device(optimizer: torch.optim.Optimizer | None, scaler: LossScaler) -> bool:
    """Whether ``optimizer`` can skip a non-finite step on the device: torch's fused Adam and
    AdamW take ``found_inf`` (their kernel leaves weights, moments and step counters
    unchanged where it is 1), and the scaler's scale is fixed, so no host decision waits on
    the overflow (a dynamic scale backs off or grows on the host). bf16_pure's rounded step
    (RoundedUpdate) writes its fp32 shadows back whatever the kernel did, so it is left out.
    """
    return (
        isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
        and not isinstance(optimizer, RoundedUpdate)
        and all(group["fused"] for group in optimizer.param_groups)
        and not scaler.settings.dynamic
    )


def overflow_checked_step(
    grads: list[torch.Tensor],
    max_norm: float,
    scaler: LossScaler,
    step: Callable[[], None],
    nonfinite_names: Callable[[], list[str]],
    device: torch.device,
    grad_replicas: int | list[int],
    group: dist.ProcessGroup | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    same_on_every_rank: bool = False,
) -> StepResult:
    """Skip the step on overflow, else unscale + clip ``grads`` in place and ``step()``.

    Where ``skips_on_device(optimizer, scaler)``, the skip decision stays on the device:
    ``step()`` always runs, with ``optimizer.found_inf`` set as GradScaler sets it, and the
    result's ``skipped`` is a device tensor, read later with the step's other values
    (``settle_skip`` then counts it, as ``scaler.update`` does here on the other path).

    Elsewhere one host read remains: whether the norm is finite, which decides whether
    ``step()`` runs at all, and is the loss scaler's input (fp16: backing off or growing the
    scale is a host decision). Without loss scaling it still guards the weights: a skipped
    step leaves weights and optimizer state unchanged, which no device-side masking of a
    generic optimizer's update can promise (AdamW would still decay the weights and its
    moments). Unscaling and clipping stay on the device: the clip coefficient is a tensor,
    and the norm is returned unread.
    """
    scale = scaler.scale
    # Of the scaled gradients.
    norm = global_grad_norm(grads, device, grad_replicas, group, same_on_every_rank)
    on_device = skips_on_device(optimizer, scaler)
    if not on_device and not torch.isfinite(norm).item():  # this path's one host sync
        scaler.update(found_inf=True)
        if scaler.gave_up:
            raise _overflow_error(scaler, nonfinite_names())
        return StepResult(grad_norm=norm, skipped=True, loss_scale=scale)
    found_inf = torch.isfinite(norm).logical_not()
    norm = norm / scale
    if grads and (max_norm > 0 or scale != 1.0):
        # g <- g / scale * min(1, max_norm / ||g / scale||), one pass over the gradients.
        # (A non-finite norm makes them nan here; the kernel then skips the step.)
        coef = torch.full_like(norm, 1.0 / scale)
        if max_norm > 0:
            coef = coef * (max_norm / (norm + 1e-6)).clamp(max=1.0)
        # An offloaded optimizer's gradients are on the host: the factor follows them there.
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    if not on_device:
        step()
        scaler.update(found_inf=False)
        return StepResult(grad_norm=norm, loss_scale=scale)
    # Read by torch's fused Adam/AdamW step; the gradients are unscaled already, so no
    # grad_scale. Removed after the step: a later step() (a checkpoint's state-making step
    # at lr 0) must not see a stale one.
    optimizer.found_inf = found_inf.float()
    try:
        # DTensor params (tensor parallel, FSDP) take the plain found_inf as replicated:
        # it is, every rank's norm being the all-reduced one.
        with implicit_replication():
            step()
    finally:
        del optimizer.found_inf
    return StepResult(grad_norm=norm, skipped=found_inf, loss_scale=scale)


def settle_skip(scaler: LossScaler, skipped: bool, step: int) -> None:
    """Count a step the optimizer skipped on the device (``skips_on_device``) once its
    ``skipped`` is read, as ``overflow_checked_step`` counts one on the host; the run stops
    when overflows keep coming. Read late, the gradients are gone: the message names the
    step instead of the parameters."""
    scaler.update(found_inf=skipped)
    if skipped and scaler.gave_up:
        raise _overflow_error(scaler, None, step)


def checked_gradient_pass(
    grads: list[torch.Tensor],
    scaler: LossScaler,
    consume: Callable[[], None],
    device: torch.device,
    grad_replicas: int | list[int],
    group: dist.ProcessGroup | None = None,
    same_on_every_rank: bool = False,
) -> bool:
    """Hand an optimizer's extra gradient pass (llm/optim/gradient_pass.py) its reduced
    gradients, unscaled; skipped (False) when they are not finite on some rank, as a step
    would be. One all-reduce and one host read, on the steps that have a pass only."""
    norm = global_grad_norm(grads, device, grad_replicas, group, same_on_every_rank)
    if not torch.isfinite(norm).item():
        return False
    if grads and scaler.scale != 1.0:
        torch._foreach_mul_(grads, 1.0 / scaler.scale)
    consume()
    return True


def _overflow_error(
    scaler: LossScaler, local_names: list[str] | None, step: int | None = None
) -> TrainingError:
    """``local_names``: this rank's parameters with non-finite gradients, or None where the
    skip was read after the step (``settle_skip``): then the last such step is named."""
    if local_names is None:
        shown = f", the last at step {step} (skipped on the device: parameters not named)"
    else:
        names = sorted({n for rank in gather_object(local_names) for n in rank})
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        shown = f" in: {', '.join(names[:8])}{more}"
    steps = scaler.overflows_at_min_scale
    if not scaler.enabled:  # fp32, tf32, bf16: there is no loss scale to blame
        return TrainingError(
            f"gradients were not finite {steps} steps in a row{shown}; lower "
            "optimizer.lr, keep train.grad_clip > 0, or check the data for extreme values"
        )
    where = "its minimum" if scaler.settings.dynamic else "static: precision.static_loss_scale"
    return TrainingError(
        f"gradients overflowed {steps} steps in a row at loss scale {scaler.scale:g} "
        f"({where}){shown}; lower the learning rate, use precision=bf16, or check "
        "the data for extreme values"
    )
