"""The strategy protocol: every parallelism option looks the same to the Trainer.

A strategy owns how a model is wrapped, how its optimizer is built, how gradients are
produced and synchronised (forward and ``backward(loss)`` run inside ``micro_batch(sync)``,
with sync False inside gradient accumulation), how a step is taken (clipping included),
what its checkpoint state is, and what it holds and sends (``state_tensors()``: the params,
grads and optimizer states this rank holds now, which the peak tracker classifies by;
``memory()``: their bytes; ``comm()``).

``wrap(model, weights)``: when ``weights`` (a llm.models WeightSource) is given, the model
arrives on the meta device and the strategy shards it first, then allocates and fills only
what this rank holds (single/ddp: the whole model; fsdp and zero3: the rank's shards;
zero1/2: the whole working buffer and the rank's master slice). Without it the model is
already materialised and the strategy takes its values as they are.

Convention: gradients are AVERAGED over data-parallel ranks (as DDP does), so the Trainer
scales each rank's summed loss by dp_size / (target tokens in the global batch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from llm.config import Config, OptimizerConfig, ParallelismConfig
from llm.errors import ConfigError
from llm.models import WeightSource
from llm.parallel.mesh import ParallelDims
from llm.parallel.step import StepResult
from llm.precision import LossScaler, PrecisionPolicy, disabled_loss_scaler


class Strategy(Protocol):
    name: str
    dims: ParallelDims

    def wrap(self, model: nn.Module, weights: WeightSource | None = None) -> nn.Module: ...

    def build_optimizer(self, model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer: ...

    def micro_batch(self, sync: bool) -> AbstractContextManager: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def clip_and_step(self, max_norm: float) -> StepResult: ...

    def zero_grad(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def state_tensors(self) -> dict[str, list[torch.Tensor]]: ...

    def memory(self) -> dict[str, int]: ...

    def comm(self) -> dict[str, int]: ...


class StrategyBase:
    """What every strategy is built with (``build_strategy``'s arguments) and holds once it
    has wrapped a model and built its optimizer."""

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


STRATEGIES: dict[str, Callable[..., Strategy]] = {}
STRATEGY_MODULES = {
    "single": "llm.parallel.single",
    "ddp": "llm.parallel.ddp",
    "zero1": "llm.parallel.zero",
    "zero2": "llm.parallel.zero",
    "zero3": "llm.parallel.zero",
    "fsdp": "llm.parallel.fsdp",
    "deepspeed": "llm.parallel.deepspeed",
}


def register_strategy(name: str):
    def decorator(cls):
        STRATEGIES[name] = cls
        return cls

    return decorator


def build_strategy(
    cfg: ParallelismConfig,
    dims: ParallelDims,
    precision: PrecisionPolicy,
    device: torch.device,
    loss_scaler: LossScaler | None = None,
    run_config: Config | None = None,
) -> Strategy:
    if cfg.name in STRATEGY_MODULES:
        # Importing a module registers its strategies; only the chosen one is imported, so
        # a DDP run never pays for importing DeepSpeed.
        importlib.import_module(STRATEGY_MODULES[cfg.name])
    if cfg.name not in STRATEGIES:
        raise ConfigError(
            f"parallelism={cfg.name!r} is unknown; choose one of {', '.join(sorted(STRATEGIES))}"
        )
    strategy = STRATEGIES[cfg.name]
    if getattr(strategy, "needs_run_config", False):
        # DeepSpeed builds its engine from batch sizes, clipping and optimizer settings too.
        return strategy(cfg, dims, precision, device, loss_scaler, run_config=run_config)
    return strategy(cfg, dims, precision, device, loss_scaler)
