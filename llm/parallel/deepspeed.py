"""parallelism=deepspeed: DeepSpeed's engine (ZeRO stages 0-3, offload) behind our protocol.

The engine is built from a ds_config generated from our groups (or a user's file with its
"auto" values filled, llm/parallel/ds_config.py). How the protocol maps onto it:

- wrap -> the engine; the Trainer calls it as the model.
- micro_batch(sync) -> ``set_gradient_accumulation_boundary(sync)``: stages 0/1 reduce only at
  the boundary; ZeRO-2/3 reduce every micro-batch (they partition gradients as they are
  produced), as DeepSpeed does.
- backward -> ``engine.backward(loss, scale_wrt_gas=False)``: the Trainer already divided by
  the whole accumulated global batch, so DeepSpeed must not divide by the steps again.
- clip_and_step -> ``engine.step()`` once per optimizer step; clipping is DeepSpeed's
  ``gradient_clipping`` (train.grad_clip, fixed when the engine is built).
- the optimizer our scheduler drives is the torch optimizer inside the engine, whose param
  groups DeepSpeed steps: the lr our LambdaLR writes there is the lr DeepSpeed applies.
- take_sent() reads DeepSpeed's comms logger, enabled with parallelism.count_comm only (it
  synchronises the device after every collective); {} otherwise.
- state_tensors() names what the engine holds now (working params and ZeRO-3 partitions,
  module and master .grad and ZeRO's gradient partitions, fp32 master partitions and
  moments). The peak tracker (llm/memory/peak.py) reads it at the same moments for every
  strategy: at each phase boundary and when autograd finishes a backward, which is before
  DeepSpeed's own end-of-backward epilogue reduces the full gradients and frees them. So
  DeepSpeed's memory_peak is measured like ours, not at a point of its own.
- memory() (the steady-state model_state_bytes) is state_tensors()' bytes, except that
  DeepSpeed frees gradients inside step(), where every other strategy keeps them until
  zero_grad(): its grads are the most this rank held during the last step, sampled when
  autograd finishes each backward (the tracker's moment) and after DeepSpeed's epilogue, on
  the steps that measure (probes, ``measure()``) only.

Under fp32 DeepSpeed does not check gradients for inf/nan (fp16 and bf16 do, and skip), so a
non-finite step is applied; the monitor's stop_on_nan ends such a run.

Checkpoints use the keys and shapes every other strategy writes (llm/parallel/ds_checkpoint.py),
so they move between world sizes, ZeRO stages and strategies.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import deepspeed
import torch
import torch.distributed as dist
from deepspeed import comm as ds_comm
from deepspeed.utils import groups as ds_groups
from torch import nn

from llm.config import Config, OptimizerConfig, ParallelismConfig
from llm.errors import ConfigError
from llm.memory import optimizer_state_tensors, state_bytes, storage_bytes
from llm.models import WeightSource, materialize_from
from llm.optim import GradientPass, build_optimizer, optimizer_param_groups
from llm.parallel import ds_checkpoint as ckpt
from llm.parallel.ds_config import checked_ds_config
from llm.parallel.ds_ops import SHM_COMM, announce_builds, optimizer_ops, swap_ops
from llm.parallel.mesh import ParallelDims
from llm.parallel.step import StepResult
from llm.parallel.strategy import refuse_optimizer, register_strategy
from llm.precision import LossScaler, PrecisionPolicy, disabled_loss_scaler

# Where DeepSpeed's ZeRO optimizers keep gradients between backward and step (stage 1/2:
# the averaged fp32 partition; stage 2: the contiguous partition buffer; stage 3: its flat
# partition buffer); module .grad and the masters' .grad are counted besides.
GRAD_BUFFERS = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer")


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors(value)


def _kind(op: str) -> tuple[str, bool]:
    """Our name for a collective DeepSpeed logged, and whether its logged size is the local
    shard (all-gathers log their input) rather than the full tensor."""
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        if op.startswith(kind):
            return kind, kind == "all_gather"
    return op, False


def _as_deepspeed_muon_splits(groups: list[dict], names: dict[int, str]) -> list[dict]:
    """Our groups, each cut where DeepSpeed's Muon cuts it: deepspeed.initialize tags every
    parameter of two or more dims whose name holds neither "embed" nor "lm_head" for Muon
    (``set_optimizer_flags``), overriding any tag of ours, and splits each group into its Muon
    and Adam halves. Cut here the same way, each group is one half, so DeepSpeed's param
    groups line up with ours (checkpoints name them). Its split differs from ours in one
    place: a head not named lm_head (llama's ``output.weight``) is Muon's there."""

    def deepspeed_muon(p: torch.Tensor) -> bool:
        return p.dim() >= 2 and not any(k in names[id(p)].lower() for k in ("embed", "lm_head"))

    out = []
    for group in groups:
        for muon in (True, False):
            half = [p for p in group["params"] if deepspeed_muon(p) == muon]
            if half:
                out.append({**group, "params": half, "kind": "hidden" if muon else group["kind"]})
    return out


def _require_cpu_adam() -> None:
    """ZeRO-Offload steps with DeepSpeed's CPU Adam, a C++ op JIT-built into
    TORCH_EXTENSIONS_DIR on first use (about 5 minutes on 2 cores, then cached)."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    try:
        CPUAdamBuilder().load(verbose=False)
    except Exception as exc:  # a failed build surfaces as several exception types
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"parallelism.offload_optimizer=cpu or nvme needs DeepSpeed's CPU Adam, which did "
            f"not build ({reason}); install a C++ compiler and Python headers, or set "
            "parallelism.offload_optimizer=none"
        ) from exc


def _require_async_io() -> None:
    """DeepSpeed swaps to NVMe with its async_io op, which needs libaio (the libaio-dev
    package's library and headers) to JIT-build. Without it DeepSpeed 0.19.8 fails inside
    its swapper with "Unable to JIT load the async_io op due to it not being compatible due
    to hardware/software issue. None"; this says what is missing, and the command that
    installs it (the Makefile's libaio target), instead."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise ConfigError(
            "parallelism.offload_*=nvme under deepspeed needs DeepSpeed's async_io op, which "
            "cannot build here: libaio's library and headers are missing; run `make libaio` "
            "(apt-get install libaio-dev), or use parallelism=zero3 with the same offload "
            "(our own nvme tier)"
        )


@register_strategy("deepspeed")
class DeepSpeedStrategy:
    name = "deepspeed"
    # build_strategy hands it the whole run config: the engine is built in wrap() and needs
    # the batch sizes, clipping, optimizer and loss-scaler settings up front.
    needs_run_config = True
    schedule = None  # the Trainer runs the micro-batches (pipeline parallel is refused)

    def __init__(
        self,
        cfg: ParallelismConfig,
        dims: ParallelDims,
        precision: PrecisionPolicy,
        device: torch.device,
        loss_scaler: LossScaler | None = None,
        run_config: Config | None = None,
    ) -> None:
        if run_config is None:
            raise ConfigError("parallelism=deepspeed is built by llm.run with the run config")
        self.cfg, self.dims, self.precision, self.device = cfg, dims, precision, device
        self.run_config = run_config
        # Only checkpoint bookkeeping: DeepSpeed's own scaler scales and skips.
        self.scaler = loss_scaler or disabled_loss_scaler()
        # DeepSpeed caches process groups in module globals and drops them only in its own
        # destroy_process_group, while llm.run destroys torch's: a second run in this process
        # (a sweep, a test) must not reuse the first run's dead groups.
        ds_groups._release_process_group_references()
        if device.type == "cpu":
            announce_builds([SHM_COMM])  # init_distributed builds it on the CPU accelerator
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        self.engine = None
        self.inner: torch.optim.Optimizer | None = None
        self._sent_before: Counter[str] = Counter()
        self._grad_bytes = self._step_grad_bytes = 0
        self._measuring = True  # until the Trainer says per step (measure())

    # ---- building ---------------------------------------------------------------------
    def wrap(self, model: nn.Module, weights: WeightSource | None = None) -> nn.Module:
        if weights is not None:
            # The whole model on every rank, then DeepSpeed partitions it: its own
            # zero.Init (partitioning at construction) is not used, so start-up under
            # ZeRO-3 peaks at a full model per rank (docs/zero.md, Known limits).
            materialize_from(model, weights, self.device)
        opt_cfg = self.run_config.optimizer
        refuse_optimizer(self.name, opt_cfg.name, self.cfg.zero_stage)
        self.ds_config = checked_ds_config(
            self.run_config, self.precision, self.device, self.dims.dp_size, model.args.d_model
        )
        groups = optimizer_param_groups(model, opt_cfg)
        names = {id(p): n for n, p in model.named_parameters()}
        if opt_cfg.name == "muon":
            groups = _as_deepspeed_muon_splits(groups, names)
        self._group_names = [[names[id(p)] for p in g["params"]] for g in groups]
        # Our registry's optimizer where the ds_config names none (sgd, lion, ...): a client
        # optimizer, stepped on DeepSpeed's flat fp32 partitions (element-wise ones only:
        # llm.parallel.strategy.refuse_optimizer).
        client = None if "optimizer" in self.ds_config else build_optimizer(model, opt_cfg)
        announce_builds(optimizer_ops(self.ds_config, self.device) + swap_ops(self.ds_config))
        if "nvme" in (self.cfg.offload_optimizer, self.cfg.offload_params):
            _require_async_io()
        if client is None and self.cfg.offload_optimizer != "none":
            _require_cpu_adam()
        self.engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=groups,
            optimizer=client,
            config=self.ds_config,
            dist_init_required=False,
        )
        # The torch optimizer DeepSpeed steps (over its fp32 partitions under ZeRO).
        self.inner = self.engine.basic_optimizer
        # The logger is a process-wide object that deepspeed.initialize switches on but
        # never off: an earlier engine in this process (a sweep, a test) may have left it on.
        ds_comm.comms_logger.enabled = self.cfg.count_comm
        self._sent_before = self._comm_totals()  # the engine's start-up broadcasts are no step's
        return self.engine

    def build_optimizer(self, model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        if model is not self.engine:
            raise ConfigError("parallelism=deepspeed: build the optimizer on the wrapped engine")
        return self.inner

    # ---- one step ---------------------------------------------------------------------
    def micro_batch(self, sync: bool):
        self.engine.set_gradient_accumulation_boundary(sync)
        return contextlib.nullcontext()

    def loss_context(self, training: bool = True):
        # Tensor parallel is refused with DeepSpeed: the loss is plain cross-entropy.
        return contextlib.nullcontext()

    def offload_facts(self) -> dict | None:
        """DeepSpeed's NVMe swapping keeps its own files and counters."""
        return None

    def close(self) -> None:
        """DeepSpeed's swap files stay under nvme_path/zero_stage_3 as it leaves them."""

    def measure(self, on: bool) -> None:
        self._measuring = on

    def backward(self, loss: torch.Tensor) -> None:
        # The gradient samples feed memory(), read on probe steps only: a hook and a walk
        # over every gradient per micro-batch that other steps need not pay for.
        if self._measuring and loss.requires_grad:
            loss.register_hook(self._count_grads_when_backward_ends)
        self.engine.backward(loss, scale_wrt_gas=False)
        if self._measuring:
            self._sample_grads()

    def _count_grads_when_backward_ends(self, grad: torch.Tensor) -> torch.Tensor:
        # Autograd runs queued callbacks once every gradient of this backward exists, before
        # DeepSpeed's epilogue reduces them into partitions and frees the full ones: the
        # most gradient memory a rank holds (ZeRO-1's full gradients live until then).
        torch.autograd.Variable._execution_engine.queue_callback(self._sample_grads)
        return grad

    def _sample_grads(self) -> None:
        self._grad_bytes = max(self._grad_bytes, storage_bytes(self._held_grads()))

    def clip_and_step(self, max_norm: float) -> StepResult:
        scale = self._loss_scale()  # the one this step's backward used
        # Stage 0 keeps no norm; its gradients are whole and averaged on every rank here.
        norm = self._replica_grad_norm() if self.cfg.zero_stage == 0 else None
        self._step_grad_bytes, self._grad_bytes = self._grad_bytes, 0
        self.engine.step()
        if norm is None:
            norm = float(self.engine.get_global_grad_norm())
        return StepResult(norm, skipped=not self.engine.was_step_applied(), loss_scale=scale)

    def _loss_scale(self) -> float:
        return float(self.engine._get_optimizer_loss_scale() or 1.0)  # 1 without fp16

    def _replica_grad_norm(self) -> float:
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def zero_grad(self) -> None:
        """Nothing to do: engine.step() clears DeepSpeed's gradients itself."""

    def gradient_pass(self, step: int) -> GradientPass | None:
        """None: optimizers that ask for one are refused under DeepSpeed (its engine cannot
        hand gradients to an optimizer without stepping)."""
        return None

    def take_gradient_pass(self, extra: GradientPass, tokens: torch.Tensor) -> None:
        raise ConfigError("parallelism=deepspeed runs no optimizer gradient pass")

    # ---- checkpoints ------------------------------------------------------------------
    def _flats(self):
        return ckpt.optimizer_flats(self.engine, self.inner)

    def state_dict(self) -> dict:
        # Sharded over ranks under ZeRO; stage 0 holds whole replicas (DCP saves one copy).
        shard = self.cfg.zero_stage > 0 and self.dims.dp_size > 1
        state = ckpt.checkpoint_state(self.engine, self.inner, self._group_names, shard)
        scaler = self.scaler.state_dict()
        scaler["scale"] = self._loss_scale()
        scaler["skipped_steps"] = self.engine.skipped_steps
        return {**state, "loss_scaler": scaler}

    def load_state_dict(self, state: dict) -> None:
        ckpt.restore(self.engine, self.inner, state["optimizer"])
        if hasattr(self.engine.optimizer, "loss_scale_config"):  # fp16; the window restarts
            self.engine.optimizer.loss_scale_config.cur_scale = float(state["loss_scaler"]["scale"])
        self.engine.skipped_steps = int(state["loss_scaler"]["skipped_steps"])
        self._sent_before = self._comm_totals()  # the restore's gathers are no step's

    # ---- measurements -----------------------------------------------------------------
    def _held_grads(self) -> list[torch.Tensor]:
        opt = self.engine.optimizer
        held = [p.grad for p in self.engine.module.parameters()]
        held += [flat.grad for flat, _ in self._flats()]
        for attr in GRAD_BUFFERS:
            held += _tensors(getattr(opt, attr, None))
        return [g for g in held if g is not None]

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Working params (ZeRO-3: its partitions plus persistent and currently gathered
        params), gradients held now, and fp32 master partitions plus optimizer states."""
        if self.engine is None:
            return {}
        module = self.engine.module
        params = list(module.parameters()) + [
            getattr(p, "ds_tensor", None) for p in module.parameters()
        ]
        masters = [flat for flat, _ in self._flats()] if self.cfg.zero_stage else []
        return {
            "params": [p for p in params if p is not None],
            "grads": self._held_grads(),
            "optimizer_states": masters + optimizer_state_tensors(self.inner),
        }

    def memory(self) -> dict[str, int]:
        """state_tensors()' bytes, with grads at their largest during the last step
        (DeepSpeed frees them inside step())."""
        return {**state_bytes(self.state_tensors()), "grads": self._step_grad_bytes}

    def _comm_totals(self) -> Counter[str]:
        totals: Counter[str] = Counter()
        for op, sizes in ds_comm.comms_logger.comms_dict.items():
            kind, shard = _kind(op)
            sent = sum(size * record[0] for size, record in sizes.items())
            totals[kind] += sent * (self.dims.dp_size if shard else 1)
        return totals

    def count_comm(self, on: bool) -> None:
        """Log the collectives of the steps to come or not (the logger syncs after each to
        time it); only ever on with parallelism.count_comm."""
        ds_comm.comms_logger.enabled = on and self.cfg.count_comm

    def take_sent(self) -> dict[str, int]:
        """Payload bytes per collective kind since the last call: the full-size tensor each
        collective operates on, per rank (an all-gather counts its output, a reduce-scatter
        its input), as DDP's all-reduce counts its bucket. {} unless parallelism.count_comm."""
        if not self.cfg.count_comm:
            return {}
        totals = self._comm_totals()
        sent = {k: v - self._sent_before[k] for k, v in totals.items() if v > self._sent_before[k]}
        self._sent_before = totals
        return sent
