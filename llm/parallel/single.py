"""One process, the whole model: the reference every other strategy is checked against,
and the base of the replica strategies (ddp, fsdp), which change only how gradients are
synchronised. Its step is llm.parallel.step's overflow-checked step."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from llm.config import OptimizerConfig
from llm.memory import module_state_tensors, state_bytes
from llm.models import WeightSource, materialize_from
from llm.optim import GradientPass, build_optimizer, materialize_state, wrap_optimizer
from llm.parallel.experts.checkpoint import from_checkpoint as experts_from_checkpoint
from llm.parallel.experts.checkpoint import to_checkpoint as experts_to_checkpoint
from llm.parallel.pipeline import part_weights
from llm.parallel.step import StepResult, checked_gradient_pass, overflow_checked_step
from llm.parallel.strategy import StrategyBase, refuse_optimizer, register_strategy
from llm.parallel.tensor_parallel import align_grads, local_tensor, tp_copies


@register_strategy("single")
class SingleStrategy(StrategyBase):
    """Holds a full replica; subclasses change how gradients are synchronised."""

    name = "single"

    # ---- hooks subclasses override ----------------------------------------------------
    @property
    def dp_replicas(self) -> int:
        """How many data-parallel ranks hold each gradient element after synchronisation
        (the dp size for replicas, 1 when gradients are sharded over dp)."""
        return self.dims.dp_size

    @property
    def grad_replicas(self) -> list[int]:
        """How many ranks hold each of ``local_grads()``: its dp replicas times its tensor
        parallel copies (norms and row-parallel biases repeat on every tp rank); divides
        each gradient's share of the summed norm."""
        tp = self.dims.tp_size
        pp = self.schedule.grad_copies if self.schedule is not None else lambda _: 1
        dp = self.dp_replicas
        experts = self.expert_shards
        return [
            (experts.replicas() if experts and experts.holds(p) else dp) * tp_copies(p, tp) * pp(p)
            for p in self._params_with_grads()
        ]

    @property
    def grads_same_on_every_rank(self) -> bool:
        """Whether every rank holds the same gradients when the step begins, so the norm
        needs no all-reduce (DDP's override). Not here: tensor and pipeline parallel ranks
        hold different parts, and one process issues no collective anyway."""
        return False

    def _params_with_grads(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.grad is not None]

    def local_grads(self) -> list[torch.Tensor]:
        """The gradient tensors this rank holds (whole for replicas, the local shards of
        DTensors under tensor parallel and FSDP; in-place ops on them change the DTensor)."""
        return [local_tensor(p.grad) for p in self._params_with_grads()]

    def nonfinite_grad_names(self) -> list[str]:
        """Names of parameters with inf/nan gradient elements on this rank."""
        return [
            name
            for name, p in self.model.named_parameters()
            if p.grad is not None and not torch.isfinite(local_tensor(p.grad)).all()
        ]

    def optimizer_step(self) -> None:
        self.optimizer.step()

    # ---- the protocol -----------------------------------------------------------------
    def wrap(self, model: nn.Module, weights: WeightSource | None = None) -> nn.Module:
        if weights is not None:
            materialize_from(model, part_weights(model, weights), self.device)
        self.model = model
        self._attach_pipeline(model)
        return model

    def build_optimizer(self, model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        refuse_optimizer(self.name, cfg.name, tp_size=self.dims.tp_size)
        self.optimizer = wrap_optimizer(build_optimizer(model, cfg), self.precision.update_rounding)
        return self.optimizer

    def micro_batch(self, sync: bool):
        """Context for one micro-batch's forward and backward; ``sync`` is False inside
        gradient accumulation. DDP needs it around the forward too, hence a context
        rather than a flag on backward()."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale_loss(loss).backward()

    def clip_and_step(self, max_norm: float) -> StepResult:
        align_grads(self.model)
        if self.schedule is not None:
            self.schedule.sum_tied_grads()
        return overflow_checked_step(
            self.local_grads(),
            max_norm,
            self.scaler,
            self.optimizer_step,
            self.nonfinite_grad_names,
            self.device,
            self.grad_replicas,
            optimizer=self.optimizer,
            same_on_every_rank=self.grads_same_on_every_rank,
        )

    def take_gradient_pass(self, extra: GradientPass, tokens: torch.Tensor) -> None:
        """The pass's gradients are the params' .grad (synchronised as a step's are)."""
        checked_gradient_pass(
            self.local_grads(),
            self.scaler,
            lambda: extra.consume(tokens),
            self.device,
            self.grad_replicas,
            same_on_every_rank=self.grads_same_on_every_rank,
        )

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        self._create_optimizer_state()
        # get_state_dict strips wrapper prefixes (DDP's "module.") and keys the optimizer
        # state by parameter name, so checkpoints move between strategies and world sizes.
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if self.schedule is not None:
            optim_sd = self.schedule.checkpoint_names(optim_sd, whole=True)
        state = {"model": model_sd, "optimizer": optim_sd, "loss_scaler": self.scaler.state_dict()}
        return experts_to_checkpoint(self.expert_shards, state) if self.expert_shards else state

    @torch.no_grad()
    def _create_optimizer_state(self) -> None:
        """Make the optimizer's lazily made state (Adam's moments) before a checkpoint is
        loaded into it, one parameter at a time. torch's get_state_dict would make it with a
        zero gradient for every parameter at once: one more fp32 copy of this rank's
        parameters (730 MB per rank for gpt2-large on 4 FSDP ranks) at the moment a run
        resumes. One at a time, the temporaries are the largest parameter's."""
        if self.optimizer.state:
            return
        for gi, group in enumerate(self.optimizer.param_groups):
            for param in list(group["params"]):
                if param.requires_grad:
                    materialize_state(self.optimizer, [(param, gi)])

    def load_state_dict(self, state: dict) -> None:
        if self.expert_shards:
            state = experts_from_checkpoint(self.expert_shards, state)
        optim_sd = state["optimizer"]
        if self.schedule is not None:
            optim_sd = self.schedule.checkpoint_names(optim_sd, whole=False)
            # A stage's param_groups name its own parameters only, and DCP saves one rank's
            # copy of a non-tensor value: the groups' settings are every stage's, their
            # names this stage's own.
            own = get_state_dict(self.model, self.optimizer)[1]["param_groups"]
            for group, mine in zip(optim_sd["param_groups"], own, strict=True):
                group["params"] = mine["params"]
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=optim_sd,
        )
        self.scaler.load_state_dict(state["loss_scaler"])

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The params, grads and optimizer states this rank holds now (DTensors under FSDP:
        their local shards are what is counted)."""
        if self.model is None:
            return {}
        return module_state_tensors(self.model, self.optimizer)

    def memory(self) -> dict[str, int]:
        return state_bytes(self.state_tensors())

    def take_sent(self) -> dict[str, int]:
        return self.take_mesh_sent()
