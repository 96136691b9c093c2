"""One estimate for one configuration: model states (llm.estimate.states), activations
(llm.estimate.activations), communication per step, and the total against device memory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llm.config import Config
from llm.estimate.activations import estimate_activations
from llm.estimate.states import RankStates, model_states, paper_states
from llm.models import build_model, freeze
from llm.parallel.tensor_parallel import padded_vocab
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
    """Per-rank bytes by row (device), what offload moves to host, and the step's payload."""

    device: dict[str, int]
    host: dict[str, int]
    comm_bytes: int
    world: int
    rank: int
    device_memory: int
    activations: dict | None = None  # per-layer terms, outside terms, counts

    @property
    def total(self) -> int:
        return sum(self.device.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory

    def to_json(self) -> dict:
        return {
            "world": self.world,
            "rank": self.rank,
            "device_bytes": self.device,
            "host_bytes": self.host,
            "total_bytes": self.total,
            "device_memory_bytes": self.device_memory,
            "fits": self.fits,
            "comm_bytes_per_step": self.comm_bytes,
            "activations": self.activations,
        }


def estimate_policy(name: str, device: str) -> PrecisionPolicy:
    """The precision policy ``name`` would resolve to on ``device``, without that device
    here: the dtypes are what matter (auto is bf16 on CUDA, tf32 and fp8 keep fp32 / bf16
    tensors)."""
    if device == "cuda":
        name = {"auto": "bf16", "tf32": "fp32", "fp8": "bf16"}.get(name, name)
    return resolve_precision(name, torch.device("cpu"))


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


def estimate(cfg: Config, args, recompute: str | None = None, model=None) -> Estimate:
    """The estimate of ``cfg`` for the model shape ``args`` (llm.validate.model_args_for);
    ``recompute`` replaces recompute.name (the plan asks for policies the formula knows);
    ``model``: the meta-device model already built for ``args`` (the plan builds it once)."""
    e, par = cfg.estimate, cfg.parallelism
    world = world_size(cfg)
    # Tensor parallel pads the vocabulary to a multiple of tp, as the run does.
    args = dataclasses.replace(args, vocab_size=padded_vocab(args.vocab_size, par.tp_size))
    policy = estimate_policy(cfg.precision.name, e.device)
    if e.num_params is not None:
        stage = int(par.name[-1]) if par.name.startswith("zero") else par.zero_stage
        states = paper_states(int(e.num_params), world, stage, policy, cfg.optimizer)
        return _assemble(cfg, states, None, int(e.num_params), policy, world)
    model = model or meta_model(cfg, args)
    states = model_states(model, par, policy, cfg.optimizer, world, e.rank)
    name = recompute or cfg.recompute.name
    if name == "op_sac" and cfg.recompute.save_every_other_mm:
        name = "op_sac_every_other_mm"
    acts = estimate_activations(
        args,
        cfg.train.micro_batch_size,
        cfg.data.seq_len,
        activation_policy(policy, par.name),
        backend=cfg.attention.backend,
        sdpa_kernel=cfg.attention.sdpa_kernel,
        device=e.device,
        recompute=name,
        every=cfg.recompute.every,
        budget=cfg.recompute.memory_budget,
        tp=par.tp_size,
        sequence_parallel=par.sequence_parallel,
    )
    if name == "offload":  # the saved tensors live in pinned host memory
        states.host["activations"] = acts.n_layers * sum(acts.layer_none.values())
    n = sum(p.numel() for p in model.parameters())
    return _assemble(cfg, states, acts, n, policy, world)


def meta_model(cfg: Config, args):
    model = build_model(args, cfg.attention.backend, cfg.attention.sdpa_kernel)
    if cfg.model.freeze:
        freeze(model, cfg.model.freeze)
    return model


def _assemble(cfg: Config, states: RankStates, acts, n_params: int, policy, world: int):
    device = dict(states.device)
    summary = None
    if acts is not None:
        device["activations"] = acts.total
        summary = {
            "per_layer_bytes": acts.per_layer,
            "per_layer_terms": acts.layer,
            "n_layers": acts.n_layers,
            "n_recomputed": acts.n_recomputed,
            "outside_terms": acts.outside,
            "total_bytes": acts.total,
        }
    par = cfg.parallelism
    factor = DEEPSPEED_COMM[par.zero_stage] if par.name == "deepspeed" else COMM_FACTOR[par.name]
    if par.name == "fsdp" and not par.reshard_after_forward:
        factor = 2
    comm = 0 if world == 1 else factor * n_params * policy.reduce_dtype.itemsize
    return Estimate(
        device=device,
        host={k: v for k, v in states.host.items() if v},
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
