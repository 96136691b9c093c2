"""``estimate.plan=true``: the strategy x precision x recompute x micro-batch runs that fit
on ``estimate.num_devices`` devices of ``estimate.device_memory_gb``, best first by the
estimated step time per token under a simple cost model (docs/recompute.md):

    compute/token = (1 + recompute) * flops_per_token / (flops_per_s * precision speed)
    comm/token    = comm_bytes_per_step / bandwidth / tokens_per_rank_per_step
    time/token    = max(compute/token, comm/token)

Recompute adds forward work: full recomputes each checkpointed block's forward (a forward
is a third of a step's FLOPs, so 1/3 of the block share); selective recomputes only the
attention core (its score and value matmuls). Communication overlaps compute, as every
strategy here arranges (DDP's and our ZeRO's buckets reduce during backward, zero3 and
FSDP prefetch the next block's parameters), so a run is bound by the slower of the two and
a bigger micro-batch helps only while communication is the bound. Ties (the same time per
token) go to the run that leaves the most memory free.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm.config import Config
from llm.estimate.estimator import Estimate, estimate, meta_model, with_overrides
from llm.models import ModelArgs, flops_per_token

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
PRECISIONS = ("bf16", "fp32")
RECOMPUTES = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
# fp32 matmuls run as TF32 on tensor cores at half the 16-bit rate (A100/H100 dense).
SPEED = {"bf16": 1.0, "fp32": 0.5}


@dataclass
class Option:
    strategy: str
    precision: str
    recompute: str
    micro_batch: int
    estimate: Estimate
    recompute_fraction: float  # extra FLOPs over a step without recompute
    seconds_per_token: float


def recompute_fraction(args: ModelArgs, seq: int, recompute: str) -> float:
    """Extra FLOPs of ``recompute`` as a fraction of a training step's."""
    step = flops_per_token(args, seq)
    if recompute == "full":
        return 1 / 3  # one more forward of every block (forward = 2 of the 6 in 6N)
    if recompute == "selective":
        # QK^T and probs @ V forward: 2 matmuls of 2*s*d_attn FLOPs per token per layer.
        return 4 * args.n_layers * seq * args.n_heads * args.head_dim / step
    return 0.0


def plan(cfg: Config, args: ModelArgs) -> list[Option]:
    seq, e = cfg.data.seq_len, cfg.estimate
    per_token = flops_per_token(args, seq)
    options, model = [], meta_model(cfg, args)
    for strategy in STRATEGIES:
        for precision in PRECISIONS:
            for recompute in RECOMPUTES:
                for mb in MICRO_BATCHES:
                    run = with_overrides(
                        cfg,
                        parallelism={"name": strategy},
                        precision={"name": precision},
                        train={"micro_batch_size": mb},
                    )
                    est = estimate(run, args, recompute, model)
                    if not est.fits:
                        continue
                    extra = recompute_fraction(args, seq, recompute)
                    compute = (1 + extra) * per_token / (e.flops_per_s * SPEED[precision])
                    comm = est.comm_bytes / (e.bandwidth_gb_s * 1e9) / (mb * seq)
                    options.append(
                        Option(strategy, precision, recompute, mb, est, extra, max(compute, comm))
                    )
    return sorted(options, key=lambda o: (o.seconds_per_token, o.estimate.total))
