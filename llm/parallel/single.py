"""One process, the whole model: the reference every other strategy is checked against."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from llm.config import OptimizerConfig, ParallelismConfig
from llm.optim import build_optimizer
from llm.parallel.mesh import ParallelDims
from llm.parallel.strategy import StepResult, register_strategy
from llm.precision import PrecisionPolicy
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
    ) -> None:
        self.cfg = cfg
        self.dims = dims
        self.precision = precision
        self.device = device
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        self.model = model
        return model

    def build_optimizer(self, model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        self.optimizer = build_optimizer(model, cfg)
        return self.optimizer

    def micro_batch(self, sync: bool):
        """Context for one micro-batch's forward and backward; ``sync`` is False inside
        gradient accumulation. DDP needs it around the forward too, hence a context
        rather than a flag on backward()."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_and_step(self, max_norm: float) -> StepResult:
        params = [p for p in self.model.parameters() if p.grad is not None]
        # max_norm=inf computes the norm without scaling anything.
        limit = max_norm if max_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, limit, foreach=True)
        self.optimizer.step()
        return StepResult(grad_norm=float(grad_norm))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        # get_state_dict strips wrapper prefixes (DDP's "module.") and keys the optimizer
        # state by parameter name, so checkpoints move between strategies and world sizes.
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )

    def memory(self) -> dict[str, int]:
        return model_state_bytes(self.model, self.optimizer)

    def comm(self) -> dict[str, int]:
        return {}
