"""The runs behind the nccl section: each strategy trained by train.py's code (llm.launch /
llm.run.main) on a config composed from conf/ as train.py composes it, with every step's
loss and (on CUDA) every host sync recorded per step.

Every step's loss: the trainer reads the steps since the last read together, on logged
steps, and hands each one's loss to ``Monitor.check``; ``traced`` records what it is handed.
Syncs: under ``torch.cuda.set_sync_debug_mode("warn")`` each synchronising CUDA call warns,
as a Python warning where Python called it (autograd's backward thread hands its warnings
back to the caller), else printed by C++ to stderr; ``traced`` counts both by the step in
flight, a step running from the start of its ``Trainer.train_step`` to the start of the
next one (the last step's window holds the final evaluation too).

Two ranks on one GPU: ``pair_rank`` runs as each of two spawned processes, starting rank
``rank`` as an outside launcher does (torchrun, or Slurm binding one GPU per task): both
see the one GPU as their local device (local_rank 0), the config is checked with the
world size given, and llm.run.main trains each strategy in turn, each on a port of its own.
"""

from __future__ import annotations

import bisect
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.gpu_pass.estimator import compose_config
from llm.errors import LabError
from llm.launch.launcher import launch
from llm.parallel.dist import RankEnv
from llm.train.monitor import Monitor
from llm.train.trainer import Trainer
from llm.validate import validate

SYNC_WARNING = "called a synchronizing CUDA operation"
NATIVE_SITE = "printed by C++ (no Python caller)"
REPO = Path(__file__).resolve().parents[2]
# The collectives the strategies' two-rank runs need, each tried on a device tensor first.
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")


@dataclass
class Trace:
    """One run's losses by step, and its sync warnings by step (0: before step 1) with the
    line that made each."""

    losses: dict[int, float] = field(default_factory=dict)
    syncs: dict[int, list[str]] = field(default_factory=dict)
    step: int = 0


def _site(filename: str, lineno: int) -> str:
    """A line of the repository by its path in it, of an installed package by its path in
    site-packages (deepspeed/runtime/utils.py)."""
    path = Path(filename).resolve()
    if "-packages/" in str(path):
        return f"{str(path).rsplit('-packages/', 1)[-1]}:{lineno}"
    return f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{lineno}"


@contextmanager
def native_syncs(trace: Trace) -> Iterator[Callable[[int], None]]:
    """Count the sync warnings C++ prints to stderr itself, those made where no Python
    warning handler is installed (inside torch.distributed's bindings, for one): stderr goes
    to a file meanwhile, marked at each step's start by the callable yielded; at the end each
    such line is counted at the step it was printed in, and the other lines are printed."""
    sys.stderr.flush()
    saved = os.dup(2)
    marks = [(0, 0)]  # (stderr's byte offset, the step starting there)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)

        def mark(step: int) -> None:
            sys.stderr.flush()
            marks.append((os.lseek(2, 0, os.SEEK_CUR), step))

        try:
            yield mark
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            offsets, kept, at = [m[0] for m in marks], [], 0
            for line in captured:
                if SYNC_WARNING.encode() in line:
                    step = marks[bisect.bisect_right(offsets, at) - 1][1]
                    trace.syncs.setdefault(step, []).append(NATIVE_SITE)
                else:
                    kept.append(line)
                at += len(line)
            os.write(2, b"".join(kept))


@contextmanager
def traced(count_syncs: bool) -> Iterator[Trace]:
    """Record every step's loss, and with ``count_syncs`` every host sync by step (CUDA's
    sync debug mode set to warn for the duration): those Python sees as warnings, with the
    line that made each, and those C++ prints itself (``native_syncs``)."""
    trace = Trace()
    train_step, check = Trainer.train_step, Monitor.check
    with ExitStack() as stack:
        mark = stack.enter_context(native_syncs(trace)) if count_syncs else None

        def marked_step(self, timer, stop):
            trace.step = self.state.step + 1
            if mark is not None:
                mark(trace.step)
            return train_step(self, timer, stop)

        def recorded_check(self, step, metrics):
            trace.losses[step] = float(metrics["loss"])
            return check(self, step, metrics)

        stack.enter_context(warnings.catch_warnings())
        shown = warnings.showwarning

        def counted(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                trace.syncs.setdefault(trace.step, []).append(_site(filename, lineno))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        warnings.showwarning = counted
        Trainer.train_step, Monitor.check = marked_step, recorded_check
        if count_syncs:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield trace
        finally:
            if count_syncs:
                torch.cuda.set_sync_debug_mode("default")
            Trainer.train_step, Monitor.check = train_step, check


def run_config(overrides: list[str], world_size: int):
    """The config train.py composes from ``overrides``, checked as train.py checks it
    (``world_size`` given, as under an outside launcher, when ranks start apart)."""
    cfg = compose_config(overrides)
    validate(cfg, world_size=world_size if world_size > 1 else None)
    return cfg


def one_rank(overrides: list[str], count_syncs: bool) -> Trace:
    """One rank trained by llm.launch in this process, as ``python train.py`` runs it."""
    cfg = run_config(overrides, 1)
    with traced(count_syncs) as trace:
        launch(cfg)
    return trace


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _probe(name: str, dev: torch.device, world: int) -> None:
    """One collective of ``name`` on tensors of ``dev``, as the strategies call it."""
    from llm.comm.collectives import all_gather, reduce_scatter

    x = torch.ones(world * 4, device=dev)
    if name == "all_reduce":
        dist.all_reduce(x)
    elif name == "broadcast":
        dist.broadcast(x, src=0)
    elif name == "all_gather":
        all_gather(torch.empty(world * 4, device=dev), x[:4].contiguous())
    elif name == "reduce_scatter":
        reduce_scatter(torch.empty(4, device=dev), x)
    else:
        dist.all_to_all_single(torch.empty_like(x), x)
    if dev.type == "cuda":
        torch.cuda.synchronize()


def probe_collectives(env: RankEnv, backend: str, dev: torch.device) -> dict[str, str | None]:
    """Each collective of COLLECTIVES on a ``dev`` tensor over ``backend``: None where it
    ran, else its error's first line."""
    dist.init_process_group(backend, init_method=env.init_url, rank=env.rank, world_size=2)
    found = {}
    try:
        for name in COLLECTIVES:
            try:
                _probe(name, dev, env.world_size)
                found[name] = None
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                found[name] = first_line(exc)
    finally:
        dist.destroy_process_group()
    return found


@dataclass(frozen=True)
class PairPlan:
    """What the two ranks do: the ports (one per run, and one for the probe), each run's
    label, collectives needed and overrides, and where rank 0 writes what it found."""

    ports: list[int]
    runs: list[tuple[str, list[str], list[str]]]  # (label, needs, overrides)
    out: str
    backend: str
    device: str


def pair_rank(rank: int, plan: PairPlan) -> None:
    """Rank ``rank`` of two: probe the collectives, then train each run whose collectives
    all ran; rank 0 writes {"probe": ..., "runs": {label: {"losses" | "error" | "skipped"}}}
    after each run, so what finished survives a run that hangs."""
    os.environ["LOCAL_RANK"] = "0"  # DeepSpeed reads it; both ranks are on the one device
    dev = torch.device(plan.device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    else:  # three processes share the cores: threads spinning beside each other stall them
        torch.set_num_threads(1)
    envs = [RankEnv(rank, 0, 2, "127.0.0.1", port) for port in plan.ports]
    found: dict = {"probe": probe_collectives(envs[0], plan.backend, dev), "runs": {}}
    for env, (label, needs, overrides) in zip(envs[1:], plan.runs, strict=True):
        missing = [n for n in needs if found["probe"][n] is not None]
        if missing:
            found["runs"][label] = {"skipped": missing}
        else:
            found["runs"][label] = _train_pair(env, overrides)
        if rank == 0:
            Path(plan.out).write_text(json.dumps(found))


def _train_pair(env: RankEnv, overrides: list[str]) -> dict:
    from llm import run

    try:
        cfg = run_config(overrides, 2)
        with traced(count_syncs=False) as trace:
            run.main(cfg, env)
    except (LabError, RuntimeError, ValueError) as exc:
        return {"error": first_line(exc)}
    return {"losses": trace.losses}
