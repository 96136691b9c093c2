"""Muon's two distributed modes side by side: per rank, the bytes its collectives carried
(the strategy's own counter, ``parallelism.count_comm``) beside the layout's formula
(llm/optim/muon_costs.py), the Newton-Schulz FLOPs torch's FlopCounterMode counted in the
optimizer step beside the formula's, and the optimizer step's time. N gloo ranks on this
machine, one process each, fp32.

    python -m benchmarks.muon_modes                         # gpt2-mini, 4 ranks, zero2 and fsdp
    python -m benchmarks.muon_modes --model gpt2-small --world 2 --strategies zero3

Columns are per rank (the largest over ranks, and the sum over ranks for FLOPs, whose excess
over one process's is the redundant work). Times on a shared CPU are a rough guide; bytes
and FLOPs do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from llm.config import OptimizerConfig, ParallelismConfig
from llm.launch.launcher import free_port
from llm.models import build_model, materialize, model_args
from llm.optim.muon_costs import muon_costs
from llm.parallel import ParallelDims, build_strategy
from llm.precision import resolve_precision

CPU = torch.device("cpu")
VOCAB, SEQ = 4096, 64


def _rank(rank, world, port, a, jobs, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        for strategy_name, mode in jobs:
            results[(strategy_name, mode, rank)] = _measure(a, strategy_name, mode, rank, world)
    finally:
        dist.destroy_process_group()


def _measure(a, strategy_name: str, mode: str, rank: int, world: int) -> dict:
    model = materialize(build_model(model_args(a.model, vocab_size=VOCAB)), CPU, 0)
    strategy = build_strategy(
        ParallelismConfig(name=strategy_name, count_comm=True),
        ParallelDims.from_config(-1, 1, 1, world, rank),
        resolve_precision("fp32", CPU),
        CPU,
    )
    wrapped = strategy.wrap(model)
    cfg = OptimizerConfig(name="muon", lr=1e-3, ns_dtype="float32", distributed=mode)
    strategy.build_optimizer(wrapped, cfg)
    g = torch.Generator().manual_seed(rank)
    for _ in range(a.steps):
        x = torch.randint(0, VOCAB, (a.batch, SEQ), generator=g)
        with strategy.micro_batch(sync=True):
            logits = wrapped(x)
            strategy.backward(F.cross_entropy(logits.flatten(0, 1), x.roll(-1, 1).flatten()))
        strategy.take_sent()  # what backward moved: not the optimizer's
        start = time.perf_counter()
        with FlopCounterMode(display=False) as flops:
            strategy.clip_and_step(max_norm=1.0)
        seconds = time.perf_counter() - start
        strategy.zero_grad()
    sent = {k: v for k, v in strategy.take_sent().items() if k.startswith("optim.")}
    layout = strategy.optimizer.shard_layout
    plan = muon_costs(layout, mode, cfg.ns_steps, momentum_bytes=4, ns_bytes=4)[layout.rank]
    return {
        "sent": sum(sent.values()),
        "formula": sum(plan["comm"].values()),
        "flops": flops.get_total_flops(),
        "flops_formula": plan["ns_flops"],
        "seconds": seconds,
    }


def table(results: dict, jobs, world: int) -> str:
    rows = [
        "| strategy | mode | optimizer comm per rank, max (MB) | its formula (MB) | "
        "Newton-Schulz GFLOP per rank, max | sum over ranks | its formula (max, sum) | "
        "optimizer step (s), max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for strategy_name, mode in jobs:
        per = [results[(strategy_name, mode, r)] for r in range(world)]
        gf = [p["flops"] / 1e9 for p in per]
        gf_formula = [p["flops_formula"] / 1e9 for p in per]
        rows.append(
            f"| {strategy_name} | {mode} | {_max_mb(per, 'sent'):.2f} | {_max_mb(per, 'formula'):.2f} | "
            f"{max(gf):.2f} | {sum(gf):.2f} | {max(gf_formula):.2f}, {sum(gf_formula):.2f} | "
            f"{max(p['seconds'] for p in per):.3f} |"
        )
    return "\n".join(rows)


def _max_mb(per: list[dict], key: str) -> float:
    return max(p[key] for p in per) / 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="gpt2-mini")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--strategies", default="zero2,fsdp")
    p.add_argument("--steps", type=int, default=2, help="the last one is measured")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--json", default="", help="also write every rank's raw figures here")
    a = p.parse_args(argv)
    jobs = [(s, m) for s in a.strategies.split(",") for m in ("gather", "owner")]
    results = mp.Manager().dict()
    mp.start_processes(
        _rank, args=(a.world, free_port(), a, jobs, results), nprocs=a.world, start_method="spawn"
    )
    print(
        f"Muon's distributed modes: {a.model}, {a.world} gloo ranks, fp32, Newton-Schulz in fp32\n"
    )
    print(table(dict(results), jobs, a.world))
    if a.json:
        raw = [{"strategy": s, "mode": m, "rank": r, **v} for (s, m, r), v in results.items()]
        Path(a.json).write_text(json.dumps(raw, indent=1) + "\n")


if __name__ == "__main__":
    main()
