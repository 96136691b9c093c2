"""Pipeline schedules measured against the formulas: the bubble, the activations a stage
holds, the bytes sent across a stage boundary.

Per schedule and micro-batch count m, ``--pp`` CPU ranks (gloo) run a model split by
llm.parallel.pipeline exactly as the Trainer runs it (strategy ``single``, its
``schedule.forward_backward``), with a fixed batch of ``--batch`` sequences split into m
micro-batches of b = batch / m; the multi-stage schedules place ``--virtual`` stages on
each rank. Per rank, beside the estimator's figures (llm.estimate.schedule_steps: closed
forms for gpipe and 1f1b, torch's own action orders for the others):

- idle: 1 - (time inside the rank's forward and backward chunks) / step time, the median
  over ``--steps`` timed steps (after ``--warmup``), beside the bubble: (p-1)/(m+p-1) for
  GPipe and 1F1B, the orders played out with unit costs for the others. Measured on shared
  CPU cores: the stages' compute must dominate, hence the defaults (d 256, 4 blocks, a byte
  vocabulary), and noise is expected.
- in flight: the most stage micro-batches whose forward ran and whose weight gradients did
  not (a full backward, or a split backward's weight half), beside the schedule's count;
  activations: the peak of live activation bytes in one tracked step
  (llm.memory.PeakTracker, at the step's peak), beside the in-flight micro-batches x the
  bytes one micro-batch's forward keeps on each stage (llm.memory.ActivationMemoryCounter).
- sent: bytes per step of the stage-to-stage sends (forward activations and backward
  gradients; ``parallelism.count_comm``'s ``pp.send_*``), beside m x b x s x h x 4 for each
  direction each of the rank's stages sends to another rank in (the last stage sends
  gradients only, the first activations only).

    python benchmarks/pipeline.py                        # pp 2, m 2,4,8, gpipe and 1f1b
    python benchmarks/pipeline.py --schedules interleaved_1f1b,interleaved_zero_bubble --microbatches 4,8
    python benchmarks/pipeline.py --pp 4 --layers 8 --microbatches 4,8,16
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm.config import PP_SINGLE_STAGE, ParallelismConfig, pp_schedule_problem
from llm.estimate.schedule_steps import bubble_share, peak_state
from llm.launch.launcher import free_port
from llm.memory import ActivationMemoryCounter, PeakTracker, module_state_tensors
from llm.models import InitSource, build_model, model_args
from llm.parallel import ParallelDims, build_strategy
from llm.parallel.pipeline import PipelineLayout, PipelinePart
from llm.precision import resolve_precision

MiB = 2**20


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


class _RankProbe:
    """Wraps the forward and backward chunks of a rank's stages: busy time and stage
    micro-batches in flight (until their weight gradients: a full backward, or the weight
    half of a split one)."""

    def __init__(self, stages) -> None:
        self.busy = 0.0
        self.in_flight = self.max_in_flight = 0
        for stage in stages:
            for name, delta in (
                ("forward_one_chunk", _forward),
                ("backward_one_chunk", _backward),
                ("backward_weight_one_chunk", _weight_half),
            ):
                setattr(stage, name, self._timed(getattr(stage, name), delta))

    def _timed(self, fn, delta):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.busy += time.perf_counter() - start
            self.in_flight += delta(*args, **kwargs)
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return out

        return run


def _forward(*args, **kwargs) -> int:
    return 1


def _backward(chunk, loss=None, full_backward=True, last_backward=False) -> int:
    return -1 if full_backward else 0  # the input half keeps what the weight half needs


def _weight_half(*args, **kwargs) -> int:
    return -1


def _rank(rank: int, world: int, port: int, opts: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for schedule in opts.schedules.split(","):
            for m in map(int, opts.microbatches.split(",")):
                row = _measure(rank, world, opts, schedule, m)
                rows = [None] * world
                dist.all_gather_object(rows, row)
                if rank == 0:
                    queue.put(rows)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, opts, schedule: str, m: int) -> dict:
    device = torch.device("cpu")
    args = dataclasses.replace(
        model_args(opts.model),
        d_model=opts.d_model,
        d_ff=4 * opts.d_model,
        n_heads=opts.d_model // 64,
        n_kv_heads=opts.d_model // 64,
        n_layers=opts.layers,
        vocab_size=256,
        max_seq_len=opts.seq_len,
    )
    v = 1 if schedule in PP_SINGLE_STAGE else opts.virtual
    cfg = ParallelismConfig(
        pp_size=world,
        pp_schedule=schedule,
        pp_microbatches=m,
        pp_virtual_stages=v,
        count_comm=True,
    )
    dims = ParallelDims.from_config(1, 1, world, world, rank)
    part = PipelinePart(build_model(args), PipelineLayout.from_config(cfg, args.n_layers), rank)
    strategy = build_strategy(cfg, dims, resolve_precision("fp32", device), device)
    strategy.wrap(part, InitSource(args, seed=0))
    pipeline = strategy.schedule
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (opts.batch, opts.seq_len + 1), generator=gen)
    batch = [(ids[:, :-1], ids[:, 1:], None)]
    scale = torch.tensor(1.0 / ids[:, 1:].numel())

    def step() -> None:
        pipeline.forward_backward(batch, scale, _loss, contextlib.nullcontext)
        part.zero_grad(set_to_none=True)

    for _ in range(opts.warmup):
        step()
    probe = _RankProbe(pipeline.stages)
    idle, sent = [], []
    for _ in range(opts.steps):
        probe.busy = 0.0
        strategy.take_sent()  # what earlier steps sent
        dist.barrier()
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
        idle.append(1 - probe.busy / wall)
        sent.append(sum(strategy.take_sent().values()))
    tracker = PeakTracker(device, "alternate")
    tracker.watch(lambda: module_state_tensors(part))
    with tracker.step(tracked=True):
        step()
    b = opts.batch // m
    return {
        "schedule": schedule,
        "m": m,
        "v": v,
        "rank": rank,
        "stages": [stage.stage_index for stage in pipeline.stages],
        "n_stages": pipeline.stages[0].num_stages,
        "idle": statistics.median(idle),
        "in_flight": probe.max_in_flight,
        "activations": tracker.last_step["activations"],
        "per_microbatch": [
            _one_microbatch(module, stage, opts, b, args.d_model)
            for module, stage in zip(part.stages(), pipeline.stages, strict=True)
        ],
        "sent": statistics.median(sent),
        "b": b,
    }


def _one_microbatch(module, stage, opts, b: int, d: int) -> int:
    """Bytes one micro-batch's forward keeps for backward on this stage (the last stage's
    loss included: its log-softmax is kept too)."""
    x = (
        torch.randint(0, 256, (b, opts.seq_len))
        if stage.is_first
        else torch.randn(b, opts.seq_len, d, requires_grad=True)
    )
    with ActivationMemoryCounter() as counter:
        out = module(x)
        if stage.is_last:
            out = _loss(out, torch.zeros(out.shape[:2], dtype=torch.long))
    del out
    return counter.activation_bytes  # parameters the matmuls save are not counted


def expected(row: dict, p: int, seq_len: int, d: int) -> dict:
    """The estimator's figures for one rank's row: bubble, stage micro-batches in flight
    (the most at once) and the activation bytes at the byte-weighted peak, bytes sent."""
    schedule, m, v, last = row["schedule"], row["m"], row["v"], row["n_stages"] - 1
    # Activations forward, gradients backward, to a neighbour stage on another rank (a V's
    # middle stages p-1 and p share the last rank: nothing is sent between them).
    mine = set(row["stages"])
    directions = sum((s < last and s + 1 not in mine) + (s > 0 and s - 1 not in mine) for s in mine)
    weighted = peak_state(schedule, p, m, v, row["rank"], row["per_microbatch"])
    return {
        "bubble": bubble_share(schedule, p, m, v),
        "in_flight": sum(peak_state(schedule, p, m, v, row["rank"]).saved),
        "activations": sum(
            n * b for n, b in zip(weighted.saved, row["per_microbatch"], strict=True)
        ),
        "sent": directions * m * row["b"] * seq_len * d * 4,
    }


def _table(all_rows: list[list[dict]], p: int, seq_len: int, d: int) -> str:
    head = (
        "| schedule | v | m | rank (stages) | idle | bubble, estimate | in flight | estimate "
        "| activations MiB | estimate MiB | sent MiB | formula MiB |"
    )
    lines = [head, "|" + " --- |" * 12]
    for rows in all_rows:
        for r in rows:
            f = expected(r, p, seq_len, d)
            stages = ", ".join(map(str, r["stages"]))
            lines.append(
                f"| {r['schedule']} | {r['v']} | {r['m']} | {r['rank']} ({stages}) "
                f"| {r['idle']:.2f} | {f['bubble']:.2f} | {r['in_flight']} | {f['in_flight']} "
                f"| {r['activations'] / MiB:.2f} | {f['activations'] / MiB:.2f} "
                f"| {r['sent'] / MiB:.2f} | {f['sent'] / MiB:.2f} |"
            )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument("--virtual", type=int, default=2, help="stages per rank (multi-stage)")
    parser.add_argument("--model", default="gpt2-tiny", help="family and init; sizes below")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    return parser.parse_args(argv)


def measure(opts: argparse.Namespace) -> list[list[dict]]:
    """One list of per-rank rows per (schedule, m), from ``--pp`` spawned ranks; a schedule
    that cannot run m micro-batches is refused before any rank starts."""
    for schedule in opts.schedules.split(","):
        v = 1 if schedule in PP_SINGLE_STAGE else opts.virtual
        for m in map(int, opts.microbatches.split(",")):
            if problem := pp_schedule_problem(schedule, opts.pp, v, m):
                raise SystemExit(problem)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, opts.pp, port, opts, queue)) for r in range(opts.pp)
    ]
    for proc in procs:
        proc.start()
    n_rows = len(opts.schedules.split(",")) * len(opts.microbatches.split(","))
    results = [queue.get() for _ in range(n_rows)]
    for proc in procs:
        proc.join()
    return results


def main() -> None:
    opts = parse()
    print(_table(measure(opts), opts.pp, opts.seq_len, opts.d_model))


if __name__ == "__main__":
    main()
