"""The optimizers experiment's sharded section (``scale=sharded``): every optimizer at one
lr under ddp, zero2 and fsdp on the same ranks, and per optimizer and strategy:
- the training loss against the same optimizer's ddp run, step by step (fp32; Muon's
  Newton-Schulz in fp32): equal within LOSS_RTOL, else a verdict that says it is not;
- the optimizer state each rank holds (measured in its storages, the largest rank) against
  ddp's whole state / N: what sharding promises, and where it gives less (Adafactor keeps
  every matrix it holds a piece of factored whole; 8-bit AdamW's absmaxes and our ZeRO's
  block padding);
- the communication per step (every collective the strategy counted, summed over kinds,
  the largest rank) against ddp's, as payloads and as the bytes a ring sends.
The jobs come from conf/experiment/optimizers_sharded.yaml; experiments/optimizers.py hands
its report here when a sweep's jobs name a parallelism.
"""

from __future__ import annotations

from collections import defaultdict

from experiments.claims import Table
from experiments.sweep import Job

# fp32 on the same batches: only the order of the ranks' gradient sums (and Adafactor's
# statistics) differ. 8-bit AdamW: a last-bit difference can move a moment across a
# quantisation level (tests/test_optim_strategies.py).
LOSS_RTOL = {"adamw8bit": 1e-3}
DEFAULT_RTOL = 1e-4


def is_sharded(jobs: list[Job]) -> bool:
    return any(j.override("parallelism") for j in jobs)


def _name(job: Job) -> str:
    return job.override("optimizer") or job.get("optimizer.name", "adamw")


def _strategy(job: Job) -> str:
    return job.override("parallelism") or "single"


def loss_gap(job: Job, reference: Job) -> float | None:
    """The largest relative difference of the logged training losses, over the steps both
    logged."""
    ours, theirs = dict(job.metric("loss")), dict(reference.metric("loss"))
    steps = sorted(set(ours) & set(theirs))
    if not steps:
        return None
    return max(abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in steps)


def _state(job: Job) -> int:
    return max(rank["optimizer_states"] for rank in job.summary["model_state_bytes"])


def _comm(job: Job, ring: bool = False) -> float:
    """The largest rank's payload per step, summed over kinds; ``ring``: the bytes a ring
    implementation sends for it, (N-1)/N of an all-gather's, reduce-scatter's or
    all-to-all's payload and 2(N-1)/N of an all-reduce's (llm/parallel/comm_counter.py)."""
    n = job.summary["world_size"]

    def sent(kind: str, payload: float) -> float:
        if not ring:
            return payload
        return payload * (n - 1) / n * (2 if kind.endswith("all_reduce") else 1)

    per_rank = job.summary.get("comm_bytes_per_step") or []
    totals = [
        sum(sent(k, v) for k, v in kinds.items()) for kinds in per_rank if isinstance(kinds, dict)
    ]
    return max(totals, default=0.0)


def report(jobs: list[Job]) -> list[Table]:
    runs: dict[str, dict[str, Job]] = defaultdict(dict)
    for j in jobs:
        runs[_name(j)][_strategy(j)] = j
    rows = []
    for opt, by_strategy in runs.items():
        ddp = by_strategy.get("ddp")
        for strategy, job in sorted(by_strategy.items()):
            if job.failed:
                rows.append((opt, strategy, f"FAILED: {job.error}", *["-"] * 7))
                continue
            ranks = job.summary["world_size"]
            rtol = LOSS_RTOL.get(opt, DEFAULT_RTOL)
            gap = loss_gap(job, ddp) if ddp is not None and not ddp.failed else None
            verdict = "-" if strategy == "ddp" else _verdict(gap, rtol)
            target = _state(ddp) / ranks if ddp is not None and not ddp.failed else None
            ok = ddp is not None and not ddp.failed
            comm_ddp, ring_ddp = (_comm(ddp), _comm(ddp, ring=True)) if ok else (None, None)
            rows.append(
                (
                    opt,
                    strategy,
                    f"{job.summary['final_train_loss']:.5f}",
                    "-" if strategy == "ddp" else (f"{gap:.1e}" if gap is not None else "n/a"),
                    verdict,
                    f"{_state(job) / 1e3:.1f}",
                    f"{_state(job) / target:.3f}" if target else "n/a",
                    f"{_comm(job) / 1e6:.3f}",
                    f"{_comm(job) / comm_ddp:.2f}" if comm_ddp else "n/a",
                    f"{_comm(job, ring=True) / ring_ddp:.2f}" if ring_ddp else "n/a",
                )
            )
    return [
        Table(
            "Sharded: each optimizer under ddp, zero2 and fsdp",
            (
                "optimizer",
                "strategy",
                "final train loss",
                "largest loss gap to ddp (relative)",
                "equal to ddp",
                "optimizer state per rank, max (KB)",
                "/ (ddp's / N)",
                "comm per step per rank, max (MB)",
                "/ ddp's",
                "ring bytes / ddp's",
            ),
            rows,
            note="Equal: every logged training loss within "
            f"{DEFAULT_RTOL:g} relative of the same optimizer's ddp run (8-bit AdamW "
            f"{LOSS_RTOL['adamw8bit']:g}). State: bytes the largest rank holds, measured in "
            "its storages, against ddp's whole state divided by the ranks (1 is what "
            "sharding promises). Comm: payload bytes of every collective the strategy "
            "counted (parallelism.count_comm), summed over kinds, the largest rank; payloads "
            "count an all-reduce's buffer once and a reduce-scatter plus an all-gather twice, "
            "so the ring bytes (what a ring implementation sends: 2(N-1)/N of an all-reduce, "
            "(N-1)/N of the others) are the like-for-like comparison.",
        )
    ]


def _verdict(gap: float | None, rtol: float) -> str:
    if gap is None:
        return "no ddp run"
    return "yes" if gap <= rtol else "no"
