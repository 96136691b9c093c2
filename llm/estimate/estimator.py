"""One estimate for one configuration: model states (llm.estimate.states), activations
(llm.estimate.activations), communication per step, and the total against device memory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llm.attention import Choice, resolve_for
from llm.config import Config
from llm.errors import ConfigError
from llm.estimate.activations import estimate_activations, outside_by_stage
from llm.estimate.backward_peak import backward_rows
from llm.estimate.gathered import gathered_saved_bytes
from llm.estimate.single_moments import loss_backward_bytes, single_moments
from llm.estimate.stages import (
    StageShape,
    held_at_peak,
    outputs_per_stage,
    receive_buffers,
    saved_per_stage,
    stage_working,
)
from llm.estimate.states import RankStates, model_states, paper_states
from llm.estimate.workspaces import training_workspaces
from llm.estimate.zero_buckets_backward import zero_buckets_backward
from llm.models import build_model, freeze
from llm.parallel.mesh import ParallelDims
from llm.parallel.pipeline import PipelineLayout, PipelinePart
from llm.parallel.tensor_parallel import check_tensor_parallel, tp_local_shapes
from llm.precision import PrecisionPolicy, resolve_precision

GIB = 2**30
# Payload bytes per step as multiples of Φ (bytes of all parameters in the reduce dtype):
# docs/zero.md's count. ddp all-reduces gradients (2Φ as reduce-scatter + all-gather);
# zero1/2 reduce-scatter gradients and all-gather updated params (2Φ); zero3 and fsdp gather
# params in forward and again in backward and reduce-scatter gradients (3Φ); fsdp without
# reshard_after_forward gathers once (2Φ).
COMM_FACTOR = {"single": 0, "ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3, "fsdp": 3}
DEEPSPEED_COMM = {0: 2, 1: 2, 2: 2, 3: 3}
RECOMPUTE_EXTRA_FORWARD = {"none": 0.0, "full": 1.0}


@dataclass
class Estimate:
    """Per-rank bytes by row (device), what offload moves to host, and the step's payload.
    ``device`` holds the rows at the end of forward; ``backward`` those at the backward
    moment where a sharded layout (llm.estimate.backward_peak) or a replica (one device, ddp:
    llm.estimate.single_moments) has one; ``optimizer_step`` a replica's during the
    optimizer step. ``total`` is the largest moment's. Under pipeline parallel the rows
    are those of the pipeline rank with the largest total (``rank``, the one that sets the
    peak) and ``stages`` lists every pipeline rank's."""

    device: dict[str, int]
    host: dict[str, int]
    comm_bytes: int
    world: int
    rank: int
    device_memory: int
    activations: dict | None = None  # per-layer terms, outside terms, counts
    stages: list[StageRows] | None = None
    disk: dict[str, int] = dataclasses.field(default_factory=dict)  # in nvme files
    backward: dict[str, int] | None = None
    optimizer_step: dict[str, int] | None = None

    @property
    def total(self) -> int:
        return sum(self.peak_rows.values())

    @property
    def moments(self) -> dict[str, dict[str, int]]:
        """The rows of each moment the estimate has, in the step's order."""
        named = {
            "forward": self.device,
            "backward": self.backward,
            "optimizer_step": self.optimizer_step,
        }
        return {name: rows for name, rows in named.items() if rows is not None}

    @property
    def peak_moment(self) -> str:
        """The moment with the largest total (the earliest of equals)."""
        moments = self.moments
        return max(moments, key=lambda name: sum(moments[name].values()))

    @property
    def peak_rows(self) -> dict[str, int]:
        return self.moments[self.peak_moment]

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory

    def to_json(self) -> dict:
        out = {
            "world": self.world,
            "rank": self.rank,
            "device_bytes": self.device,
            "backward_bytes": self.backward,
            "optimizer_step_bytes": self.optimizer_step,
            "peak_moment": self.peak_moment,
            "host_bytes": self.host,
            "nvme_bytes": self.disk,
            "total_bytes": self.total,
            "device_memory_bytes": self.device_memory,
            "fits": self.fits,
            "comm_bytes_per_step": self.comm_bytes,
            "activations": self.activations,
        }
        if self.stages is not None:
            out["stages"] = [dataclasses.asdict(s) for s in self.stages]
        return out


@dataclass
class StageRows:
    """One pipeline rank's device rows (at the dp and tp coordinate of estimate.rank)."""

    pp_rank: int
    rank: int
    device: dict[str, int]
    host: dict[str, int]
    n_params: int  # parameters of the rank's part (tensor-parallel shards: whole shapes)

    @property
    def total(self) -> int:
        return sum(self.device.values())


def estimate_attention(cfg: Config, args) -> Choice:
    """The attention kernel the estimate is for: the configured one, or attention=auto's pick
    for estimate.device (this machine's GPU where it has one; else auto's fallback, sdpa)."""
    policy = estimate_policy(cfg.precision.name, cfg.estimate.kernels, cfg.precision.fp8_recipe)
    return resolve_for(
        cfg.attention,
        args,
        device=torch.device(cfg.estimate.kernels),
        dtype=policy.compute_dtype,
        seq_len=cfg.data.seq_len,
    )


def estimate_policy(name: str, device: str, fp8_recipe: str = "tensorwise") -> PrecisionPolicy:
    """The precision policy ``name`` would resolve to on ``device``, without that device
    here: the dtypes are what matter (auto is bf16 on CUDA, tf32 keeps fp32 tensors), and
    for fp8 its recipe (what its linears save does not depend on emulation)."""
    if device == "cuda":
        name = {"auto": "bf16", "tf32": "fp32"}.get(name, name)
    return resolve_precision(name, torch.device("cpu"), fp8_recipe=fp8_recipe, fp8_emulate=True)


def activation_policy(policy: PrecisionPolicy, strategy: str) -> PrecisionPolicy:
    """Sharded strategies compute with 16-bit working weights (ZeRO, DeepSpeed; FSDP gathers
    them in the compute dtype), so the residual stream is 16-bit and autocast casts no
    weights; single and ddp keep ``param_dtype`` weights and autocast them."""
    if strategy in ("single", "ddp"):
        return policy
    return dataclasses.replace(policy, param_dtype=policy.working_dtype)


def world_size(cfg: Config) -> int:
    e = cfg.estimate
    return e.nodes * (e.gpus_per_node or cfg.launcher.nproc_per_node)


def estimate(cfg: Config, args) -> Estimate:
    """The estimate of ``cfg`` for the model shape ``args`` (llm.build.model_args_for)."""
    e, par = cfg.estimate, cfg.parallelism
    world = world_size(cfg)
    try:  # the layout the run would refuse, refused the same way
        ParallelDims.from_config(par.dp_size, par.tp_size, par.pp_size, world)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (the estimate's world: estimate.nodes x gpus_per_node)") from None
    check_tensor_parallel(args, par.tp_size, cfg.data.seq_len, par.sequence_parallel)
    # The vocabulary padded to a multiple of model.vocab_multiple x tp, as the run pads it.
    args = args.padded(cfg.model.vocab_multiple * par.tp_size)
    policy = estimate_policy(cfg.precision.name, e.kernels, cfg.precision.fp8_recipe)
    if e.num_params is not None:
        stage = int(par.name[-1]) if par.name.startswith("zero") else par.zero_stage
        offload = (par.offload_optimizer, par.offload_params)
        states = paper_states(int(e.num_params), world, stage, policy, cfg.optimizer, *offload)
        return _assemble(cfg, states, None, int(e.num_params), policy, world)
    name = cfg.recompute.name
    if name == "op_sac" and cfg.recompute.save_every_other_mm:
        name = "op_sac_every_other_mm"
    pp = par.pp_size
    micro_batch = cfg.train.micro_batch_size // (par.microbatches if pp > 1 else 1)
    stream = activation_policy(policy, par.name)
    attention = estimate_attention(cfg, args)
    acts = estimate_activations(
        args,
        micro_batch,
        cfg.data.seq_len,
        stream,
        backend=attention.backend,
        sdpa_kernel=attention.kernel,
        device=e.kernels,
        recompute=name,
        every=cfg.recompute.every,
        budget=cfg.recompute.memory_budget,
        tp=par.tp_size,
        sequence_parallel=par.sequence_parallel,
        fused_loss=cfg.train.fused_loss,
    )
    if pp > 1:
        stages = [_stage(cfg, args, acts, policy, stream, micro_batch, r) for r in range(pp)]
        peak = max(stages, key=lambda s: s.total)  # the first of equals
        states = RankStates(dict(peak.device), dict(peak.host))
        est = _assemble(cfg, states, acts, peak.n_params, policy, world)
        est.rank, est.stages = peak.rank, stages
        return _with_workspaces(est, e.device)
    model = meta_model(cfg, args)
    states = model_states(model, par, policy, cfg.optimizer, world, e.rank)
    states.device["activations"] = acts.total
    head = outside_by_stage(acts.outside)[1]
    _add_gathered(states, [model], model, cfg, policy, [head], e.rank)
    if name == "offload":  # the saved tensors live in pinned host memory
        states.host["activations"] = acts.n_layers * sum(acts.layer_none.values())
    n = sum(p.numel() for p in model.parameters())
    est = _assemble(cfg, states, acts, n, policy, world)
    loss = loss_backward_bytes(cfg, model.args, policy, micro_batch)
    est.backward = backward_rows(model, par, policy, est.device, world, loss) or (
        zero_buckets_backward(cfg, model, policy, stream, acts, est.device, world, loss)
    )
    moments = single_moments(cfg, model, policy, acts, est.device, world)
    if moments is not None:
        est.device, est.backward = moments.forward, moments.backward
        est.optimizer_step = moments.optimizer_step
    return _with_workspaces(est, e.device)


def _with_workspaces(est: Estimate, device: str) -> Estimate:
    """``est`` with the cuBLAS workspaces (llm.estimate.workspaces) in every moment's rows
    and every pipeline rank's: they persist from the first step on."""
    held = training_workspaces(device)
    if held:
        for rows in [*est.moments.values(), *(s.device for s in est.stages or [])]:
            rows["cublas_workspaces"] = held
    return est


def _stage(cfg: Config, args, acts, policy, stream, micro_batch: int, pp_rank: int) -> StageRows:
    """Pipeline rank ``pp_rank`` at estimate.rank's dp and tp coordinate: the model states
    of its part, its in-flight activations and the stage outputs the schedule keeps."""
    par = cfg.parallelism
    pipe = PipelineLayout.from_config(par, args.n_layers)
    world = world_size(cfg)
    inner = world // par.pp_size  # dp x tp ranks per pipeline rank, pp outermost
    rank = pp_rank * inner + cfg.estimate.rank % inner
    part = meta_model(cfg, args, pp_rank)
    states = model_states(part, par, policy, cfg.optimizer, world, rank)
    m = par.microbatches
    shape = StageShape(
        args, micro_batch, cfg.data.seq_len, stream, par.tp_size, par.sequence_parallel
    )
    outputs = outputs_per_stage(shape, pipe, pp_rank)
    saved = saved_per_stage(acts, pipe, pp_rank)
    held = held_at_peak(pipe, m, pp_rank, saved, outputs)
    states.device["activations"], states.device["stage_outputs"] = held
    states.device["receive_buffers"] = receive_buffers(shape, pipe, m, pp_rank)
    if pipe.n_stages - 1 not in pipe.stages_of(pp_rank):  # the last's peak is the loss's
        states.device["stage_working"] = stage_working(shape, acts, cfg.recompute.name)
    if cfg.recompute.name == "offload":  # every block's saved tensors, in host memory
        kept = dataclasses.replace(acts, layer=acts.layer_none, outside={})
        kept_saved = saved_per_stage(kept, pipe, pp_rank)
        states.host["activations"] = held_at_peak(pipe, m, pp_rank, kept_saved, outputs)[0]
    head = outside_by_stage(acts.outside)[1]
    heads = [head * (s == pipe.n_stages - 1) for s in pipe.stages_of(pp_rank)]
    _add_gathered(states, part.stages(), part, cfg, policy, heads, rank)
    if pipe.n_stages - 1 in pipe.stages_of(pp_rank):  # its micro-batch's loss's backward
        states.device["loss_backward"] = loss_backward_bytes(cfg, args, policy, micro_batch)
    n = sum(p.numel() for p in part.parameters())
    host = {k: v for k, v in states.host.items() if v}
    return StageRows(pp_rank, rank, states.device, host, n)


def _add_gathered(states: RankStates, roots, model, cfg: Config, policy, heads, rank: int) -> None:
    """The ``gathered_weights`` row where FSDP2's gathered parameters are saved by autograd
    (llm.estimate.gathered), in the working dtype FSDP2 gathers in."""
    tp = cfg.parallelism.tp_size
    shapes = tp_local_shapes(model, tp, rank % tp)
    itemsize = policy.working_dtype.itemsize
    held = gathered_saved_bytes(roots, cfg.parallelism, shapes, itemsize, heads)
    if held:
        states.device["gathered_weights"] = held


def meta_model(cfg: Config, args, pp_rank: int | None = None):
    """The model on the meta device, frozen as ``model.freeze`` says; with ``pp_rank`` that
    pipeline rank's part, split before freezing as llm.run splits it."""
    attention = estimate_attention(cfg, args)
    model = build_model(args, attention.backend, attention.kernel)
    if pp_rank is not None:
        pipe = PipelineLayout.from_config(cfg.parallelism, args.n_layers)
        model = PipelinePart(model, pipe, pp_rank)
    if cfg.model.freeze:
        if isinstance(model, PipelinePart):
            model.freeze(cfg.model.freeze)
        else:
            freeze(model, cfg.model.freeze)
    return model


def _assemble(cfg: Config, states: RankStates, acts, n_params: int, policy, world: int):
    device = dict(states.device)
    summary = None
    if acts is not None:
        summary = {
            "per_layer_bytes": acts.per_layer,
            "per_layer_terms": acts.layer,
            "n_layers": acts.n_layers,
            "n_recomputed": acts.n_recomputed,
            "outside_terms": acts.outside,
            "total_bytes": device["activations"],
        }
    par = cfg.parallelism
    factor = DEEPSPEED_COMM[par.zero_stage] if par.name == "deepspeed" else COMM_FACTOR[par.name]
    if par.name == "fsdp" and not par.reshard_after_forward:
        factor = 2
    comm = 0 if world == 1 else factor * n_params * policy.reduce_dtype.itemsize
    return Estimate(
        device=device,
        host={k: v for k, v in states.host.items() if v},
        disk={k: v for k, v in states.disk.items() if v},
        comm_bytes=comm,
        world=world,
        rank=cfg.estimate.rank,
        device_memory=int(cfg.estimate.device_memory_gb * GIB),
        activations=summary,
    )


def with_overrides(cfg: Config, **groups: dict) -> Config:
    """``cfg`` with fields of some groups replaced: ``with_overrides(cfg, train={...})``."""
    return dataclasses.replace(
        cfg, **{g: dataclasses.replace(getattr(cfg, g), **kv) for g, kv in groups.items()}
    )
