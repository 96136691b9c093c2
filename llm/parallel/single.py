"""One process, the whole model: the reference every other strategy is checked against.

Its step routine is shared by every strategy built on torch collectives: scale the loss,
find overflow on any rank or shard with one all-reduce of the squared gradient norm,
skip or unscale+clip+step, update the loss scaler.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from llm.config import OptimizerConfig, ParallelismConfig
from llm.errors import TrainingError
from llm.loss_scale import LossScaler, disabled_loss_scaler
from llm.optim import build_optimizer
from llm.parallel.mesh import ParallelDims
from llm.parallel.strategy import StepResult, register_strategy
from llm.precision import PrecisionPolicy, wrap_optimizer
from llm.train.metrics import model_state_bytes


@register_strategy("single")
class SingleStrategy:
    """Holds a full replica; subclasses change how gradients are synchronised."""

    name = "single"

    def __init__(
        self,
        cfg: ParallelismConfig,
        dims: ParallelDims,
        precision: PrecisionPolicy,
        device: torch.device,
        loss_scaler: LossScaler | None = None,
    ) -> None:
        self.cfg = cfg
        self.dims = dims
        self.precision = precision
        self.device = device
        self.scaler = loss_scaler or disabled_loss_scaler()
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    # ---- hooks subclasses override ----------------------------------------------------
    @property
    def grad_replicas(self) -> int:
        """How many ranks hold each gradient element after synchronisation (the world
        size for replicas, 1 when gradients are sharded): divides the summed norm."""
        return dist.get_world_size() if dist.is_initialized() else 1

    def local_grads(self) -> list[torch.Tensor]:
        """The gradient tensors this rank holds (whole for replicas, shards for ZeRO)."""
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def nonfinite_grad_names(self) -> list[str]:
        """Names of parameters with inf/nan gradient elements on this rank."""
        return [
            name
            for name, p in self.model.named_parameters()
            if p.grad is not None and not torch.isfinite(p.grad).all()
        ]

    def optimizer_step(self) -> None:
        self.optimizer.step()

    # ---- the protocol -----------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        self.model = model
        return model

    def build_optimizer(self, model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        self.optimizer = wrap_optimizer(build_optimizer(model, cfg), self.precision)
        return self.optimizer

    def micro_batch(self, sync: bool):
        """Context for one micro-batch's forward and backward; ``sync`` is False inside
        gradient accumulation. DDP needs it around the forward too, hence a context
        rather than a flag on backward()."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale_loss(loss).backward()

    def clip_and_step(self, max_norm: float) -> StepResult:
        grads = self.local_grads()
        scale = self.scaler.scale
        norm = self._global_grad_norm(grads)  # of the scaled gradients
        if not math.isfinite(norm):
            self._skip_step()
            return StepResult(grad_norm=norm, skipped=True, loss_scale=scale)
        norm /= scale
        # Unscale and clip in one pass: g <- g / scale * min(1, max_norm / ||g / scale||).
        clip = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
        if grads and clip / scale != 1.0:
            torch._foreach_mul_(grads, clip / scale)
        self.optimizer_step()
        self.scaler.update(found_inf=False)
        return StepResult(grad_norm=norm, loss_scale=scale)

    def _global_grad_norm(self, grads: list[torch.Tensor]) -> float:
        """L2 norm over every rank's gradients; inf/nan on any rank or shard makes it
        non-finite everywhere, which is how overflow is agreed without a second collective."""
        if grads:
            sq = torch.stack(torch._foreach_norm(grads, 2.0)).float().pow(2).sum()
        else:
            sq = torch.zeros((), device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            sq = sq.to(self.device)
            dist.all_reduce(sq)
            sq = sq / self.grad_replicas
        return math.sqrt(float(sq))

    def _skip_step(self) -> None:
        self.scaler.update(found_inf=True)
        if self.scaler.gave_up:
            names = sorted({n for rank in _gather(self.nonfinite_grad_names()) for n in rank})
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise TrainingError(
                f"gradients overflowed {self.scaler.overflows_at_min_scale} steps in a row at "
                f"loss scale {self.scaler.scale:g} (its minimum) in: {shown}; lower the "
                "learning rate, use precision=bf16, or check the data for extreme values"
            )

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        # get_state_dict strips wrapper prefixes (DDP's "module.") and keys the optimizer
        # state by parameter name, so checkpoints move between strategies and world sizes.
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd, "loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        self.scaler.load_state_dict(state["loss_scaler"])

    def memory(self) -> dict[str, int]:
        return model_state_bytes(self.model, self.optimizer)

    def comm(self) -> dict[str, int]:
        return {}


def _gather(value) -> list:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
