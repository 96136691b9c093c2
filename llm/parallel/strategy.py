"""The strategy protocol: every parallelism option looks the same to the Trainer.

A strategy owns how a model is wrapped, how its optimizer is built, how gradients are
produced and synchronised (forward and ``backward(loss)`` run inside ``micro_batch(sync)``,
with sync False inside gradient accumulation), how a step is taken (clipping included),
what its checkpoint state is, and what it holds and sends (``state_tensors()``: the params,
grads and optimizer states this rank holds now, which the peak tracker classifies by;
``memory()``: their bytes; ``take_sent()``, llm/comm/sent.py's protocol).

``wrap(model, weights)``: when ``weights`` (a llm.models WeightSource) is given, the model
arrives on the meta device and the strategy shards it first, then allocates and fills only
what this rank holds (single/ddp: the whole model; fsdp and zero3: the rank's shards;
zero1/2: the whole working buffer and the rank's master slice). Without it the model is
already materialised and the strategy takes its values as they are.

Convention: gradients are AVERAGED over data-parallel ranks (as DDP does), so the Trainer
scales each rank's summed loss by dp_size / (target tokens in the global batch).

``schedule``: None when the Trainer runs the micro-batches itself (forward and backward
inside ``micro_batch`` and ``loss_context``); under pipeline parallel, the object that runs
all of a step's micro-batches through the pipeline (``forward_backward(batches, scale,
loss_fn, forward_context) -> loss sum``, and ``evaluate``), llm/parallel/pipeline.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from llm.comm.sent import SentBytes
from llm.config import Config, OptimizerConfig, ParallelismConfig
from llm.errors import ConfigError
from llm.models import WeightSource
from llm.optim import (
    ELEMENTWISE,
    OPTIMIZERS,
    PARAM_NORMS,
    QUANT_BLOCKS,
    WHOLE_MATRICES,
    GradientPass,
    gradient_pass,
)
from llm.parallel.comm_counter import MeshCommCounter
from llm.parallel.experts.grads import ExpertGradReducer
from llm.parallel.experts.shards import ExpertShards
from llm.parallel.mesh import MESH_DIMS, ParallelDims
from llm.parallel.pipeline import GradSync, Pipeline, PipelinePart
from llm.parallel.step import StepResult
from llm.parallel.tensor_parallel import loss_parallel
from llm.precision import LossScaler, PrecisionPolicy, disabled_loss_scaler


class Strategy(SentBytes, Protocol):
    name: str
    dims: ParallelDims
    schedule: Pipeline | None

    def wrap(self, model: nn.Module, weights: WeightSource | None = None) -> nn.Module: ...

    def build_optimizer(self, model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer: ...

    def micro_batch(self, sync: bool) -> AbstractContextManager: ...

    def expert_micro_batch(self, sync: bool) -> AbstractContextManager:
        """Around a micro-batch, inside the strategy's own: the expert slices' gradients
        reduced over their edp ranks in buckets during the backward that syncs, waited for
        when it ends (llm/parallel/experts/grads.py); nothing without expert parallelism
        or where the strategy shards the slices and reduces them itself (fsdp)."""
        ...

    def loss_context(self, training: bool = True) -> AbstractContextManager: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def clip_and_step(self, max_norm: float) -> StepResult: ...

    def zero_grad(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def state_tensors(self) -> dict[str, list[torch.Tensor]]: ...

    def gradient_pass(self, step: int) -> GradientPass | None: ...

    def take_gradient_pass(self, extra: GradientPass, tokens: torch.Tensor) -> None: ...

    def memory(self) -> dict[str, int]: ...

    def count_comm(self, on: bool) -> None: ...

    def measure(self, on: bool) -> None: ...

    def offload_facts(self) -> dict | None: ...

    def close(self) -> None: ...


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
        self._mesh_counter: MeshCommCounter | None = None
        # Whether collectives are counted now: with parallelism.count_comm the Trainer turns
        # it on for probe steps only (llm/train/probes.py), never for timed ones.
        self.counting = cfg.count_comm
        self.schedule: Pipeline | None = None
        # Elements per quantisation block of the optimizer to come (8-bit AdamW: 256), so
        # that a strategy that cuts parameters cuts them at block boundaries; set before wrap
        # (build_strategy does, from the run's optimizer).
        self.quant_block = 1
        # Expert parallel (parallelism.ep_size > 1): the model's expert slices, set before
        # wrap (llm/parallel/experts/; the strategies of llm.validate's EP_STRATEGIES take
        # them, the others refuse ep).
        self.expert_shards: ExpertShards | None = None
        self._expert_grads: ExpertGradReducer | None = None

    def _attach_pipeline(self, model: nn.Module, grad_sync: GradSync | None = None) -> None:
        """Under pipeline parallel (``model`` is this rank's PipelinePart, materialised and
        sharded), build the schedule that will run its stages; ``grad_sync``: the context
        each micro-batch's backward runs in, for a strategy that reduces gradients itself."""
        if isinstance(model, PipelinePart):
            self.schedule = Pipeline(
                model,
                self.dims,
                self.cfg.microbatches,
                self.device,
                self.scaler,
                self.cfg.count_comm,
                grad_sync,
            )

    def expert_micro_batch(self, sync: bool) -> AbstractContextManager:
        """Around a micro-batch, inside the strategy's own: the expert slices' gradients
        reduced over their edp ranks in buckets during the backward that syncs, waited for
        when it ends (llm/parallel/experts/grads.py); nothing without expert parallelism
        or where the strategy shards the slices and reduces them itself (fsdp)."""
        if self.expert_shards is None or self.expert_shards.sharded:
            return contextlib.nullcontext()
        if self._expert_grads is None:  # hooks in place before the first backward
            self._expert_grads = ExpertGradReducer(
                self.expert_shards, self.cfg.bucket_cap_mb, lambda: self.counting
            )
        return self._expert_grads.micro_batch(sync)

    def loss_context(self, training: bool = True) -> AbstractContextManager:
        """Where the forward, the loss and (``training``) the backward run: under tensor
        parallel the logits stay vocab-sharded and cross-entropy runs on the shards
        (``loss_parallel``), and on a counted step (``count_comm``) a training step's DTensor
        collectives are counted by mesh dimension (``take_mesh_sent()``)."""
        stack = contextlib.ExitStack()
        if self.dims.tp_size > 1:
            stack.enter_context(loss_parallel())
            if training and self.counting:
                if self._mesh_counter is None:
                    self._mesh_counter = MeshCommCounter(self.dims.mesh, MESH_DIMS)
                stack.enter_context(self._mesh_counter)
        return stack

    def count_comm(self, on: bool) -> None:
        """Count the collectives of the steps to come (``on``) or not; counting costs time
        at every collective (under tensor parallel at every op)."""
        self.counting = on
        if self.schedule is not None:
            self.schedule.counting = on

    def measure(self, on: bool) -> None:
        """Whether the step to come is a probe (llm/train/probes.py), whose ``memory()`` the
        Trainer reads; set per step next to ``count_comm``. Only a strategy that samples
        memory during the step itself (DeepSpeed) needs to know."""

    def offload_facts(self) -> dict | None:
        """What an offload to nvme did (summary.json's ``offload``); None without one."""
        return None

    def close(self) -> None:
        """The run is over, however it ended: release what outlives the process's memory
        (our ZeRO's nvme files)."""

    def take_mesh_sent(self) -> dict[str, int]:
        """Bytes of the DTensor collectives counted since the last call (tensor parallel),
        and of the sends between pipeline stages (``pp.send_activations``,
        ``pp.send_gradients``)."""
        counted = {} if self._mesh_counter is None else self._mesh_counter.take_sent()
        return counted | ({} if self.schedule is None else self.schedule.take_sent())

    def gradient_pass(self, step: int) -> GradientPass | None:
        """The optimizer's extra gradient pass when step ``step`` (1-based) needs it, else
        None (llm/optim/gradient_pass.py): the Trainer asks, and never names the optimizer."""
        extra = gradient_pass(self.optimizer)
        return extra if extra is not None and extra.due(step) else None


# What each strategy's shards let an optimizer see (llm/optim/registry.py's layouts). Single
# and DDP hold whole replicas: every layout. Our ZeRO (flat buckets cut anywhere) and FSDP
# (dim-0 shards) run element-wise optimizers as they are, give LAMB whole-parameter norms
# through `whole_param_squares` (one all-reduce of two floats per parameter per step), and
# Adafactor and Muon a `shard_layout` (every rank's range of every parameter), over which
# they sum their statistics or make whole matrices (llm/optim/shard_layout.py); 8-bit AdamW's
# blocks do not straddle a cut (our ZeRO aligns its cuts, FSDP checks its own).
SHARDED_LAYOUTS = frozenset({ELEMENTWISE, PARAM_NORMS, WHOLE_MATRICES, QUANT_BLOCKS})
WHY_NOT = {
    WHOLE_MATRICES: "its row/column statistics or Newton-Schulz products need whole matrices "
    "and {strategy} gives each rank a slice of them",
    QUANT_BLOCKS: "its 256-element quantisation blocks would straddle {strategy}'s shard "
    "boundaries and quantise differently than on one process",
    PARAM_NORMS: "its trust ratio needs whole-parameter norms and {strategy} steps flat "
    "partitions that cut through parameters",
}


def refuse_optimizer(strategy: str, optimizer: str, zero_stage: int = 0, tp_size: int = 1) -> None:
    """Refuse, in one line, an optimizer that ``strategy`` cannot run with the updates it gives
    under ``single``; called by llm.validate before ranks start and by each build_optimizer."""
    spec = OPTIMIZERS.get(optimizer)
    if spec is not None and tp_size > 1:
        _refuse_under_tensor_parallel(optimizer, spec, tp_size)
    if spec is None or strategy in ("single", "ddp"):
        return
    if strategy == "deepspeed" and optimizer == "muon":
        return  # DeepSpeed's own Muon, at every stage (llm/parallel/ds_config.py)
    if strategy == "deepspeed":
        # Client optimizers see DeepSpeed's flat partitions (stage 0: whole parameters);
        # its engine has no way to hand an optimizer gradients without stepping.
        allowed = {ELEMENTWISE} | ({PARAM_NORMS} if zero_stage == 0 else set())
        if spec.gradient_pass:
            reason = "its extra gradient pass cannot run through DeepSpeed's engine"
            raise ConfigError(
                f"optimizer={optimizer} under parallelism=deepspeed: {reason}; use ddp, zero1-3 or fsdp"
            )
    else:
        allowed = SHARDED_LAYOUTS
    if spec.layout not in allowed:
        where = f"{strategy} zero_stage={zero_stage}" if strategy == "deepspeed" else strategy
        reason = WHY_NOT[spec.layout].format(strategy=where)
        raise ConfigError(
            f"optimizer={optimizer} under parallelism={strategy}: {reason}; use parallelism=ddp"
        )


def _refuse_under_tensor_parallel(optimizer: str, spec, tp_size: int) -> None:
    """Tensor parallel hands each rank column or row blocks of the matrices: only element-wise
    updates see what they would see whole; an extra gradient pass would sample from
    vocab-sharded logits."""
    if spec.gradient_pass:
        reason = "its extra gradient pass samples from logits that tensor parallel shards by vocab"
    elif spec.layout == PARAM_NORMS:
        reason = "its trust ratio needs whole-parameter norms and tensor parallel steps row or column blocks"
    elif spec.layout != ELEMENTWISE:
        reason = WHY_NOT[spec.layout].format(strategy="tensor parallel")
    else:
        return
    raise ConfigError(
        f"optimizer={optimizer} with parallelism.tp_size={tp_size}: {reason}; use an "
        "element-wise optimizer (adamw) or tp_size=1"
    )


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
    built = strategy(cfg, dims, precision, device, loss_scaler)
    spec = OPTIMIZERS.get(run_config.optimizer.name) if run_config is not None else None
    if spec is not None and spec.quant_block:
        built.quant_block = spec.quant_block
    return built
