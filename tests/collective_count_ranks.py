"""A rank's main for tests/test_loop_collectives.py: llm.run.main with every collective of
the training loop counted per step and written to the run directory as
collectives_rank{N}.json. Spawned ranks import it by name, so it lives in a module of its
own; a monkeypatch in the test process would not reach them.

Tensor collectives are the c10d and functional-collective ops a dispatch mode sees (what
``torch.distributed``'s functions, DDP's comm hook, FSDP2, DTensor and the pipeline's
send/recv issue), each named with the first frame in llm/ that issued it. Object
collectives are ``torch.distributed``'s ``*_object*`` functions, wrapped.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from llm import run
from llm.parallel.dist import RankEnv
from llm.train.trainer import Trainer

NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
# Ops of those namespaces that communicate nothing: waits, and funcol's autograd wrapper.
NOT_COLLECTIVES = ("wait", "wait_tensor", "_wrap_tensor_autograd")
OBJECT_COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)
LLM = str(Path(run.__file__).resolve().parent)
MEMORY = f"{LLM}/memory/"


def _caller() -> str:
    """The innermost frame in llm/ (relative path) but the peak tracker's pass-through
    dispatch mode (llm/memory/), or "torch" when none is on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(LLM) and not name.startswith(MEMORY):
            return "llm" + name[len(LLM) :]
        frame = frame.f_back
    return "torch"


class Collectives(TorchDispatchMode):
    """Counts "op @ llm/file.py" into ``steps[-1]`` (a new Counter opens at each step)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[Counter] = [Counter()]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if types and any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor: its own dispatch issues the plain collectives
        if func.namespace in NAMESPACES and func._opname not in NOT_COLLECTIVES:
            self.steps[-1][f"{func._opname} @ {_caller()}"] += 1
        return func(*args, **(kwargs or {}))

    def note_object(self, name: str) -> None:
        self.steps[-1][f"object:{name} @ {_caller()}"] += 1


def _wrap_object_collectives(counter: Collectives) -> None:
    for name in OBJECT_COLLECTIVES:
        original = getattr(c10d, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counter.note_object(_name)
            return _original(*args, **kwargs)

        setattr(c10d, name, counted)
        setattr(dist, name, counted)


def counted_main(cfg, env: RankEnv) -> dict:
    """Count from the first step's start: each step's window runs from its ``train_step`` to
    the next one's, so it holds the step's read, log and evaluation too. The last window
    (the end's evaluation, save and gathers) is dropped."""
    counter = Collectives()
    _wrap_object_collectives(counter)
    train_step, fit = Trainer.train_step, Trainer.fit

    def counted_step(self, timer, stop):
        counter.steps.append(Counter())
        return train_step(self, timer, stop)

    def counted_fit(self):
        with counter:
            return fit(self)

    Trainer.train_step, Trainer.fit = counted_step, counted_fit
    try:
        summary = run.main(cfg, env)
    finally:
        Trainer.train_step, Trainer.fit = train_step, fit
    steps = {step: dict(c) for step, c in enumerate(counter.steps[1:-1], 1)}
    Path(cfg.output_dir, f"collectives_rank{env.rank}.json").write_text(json.dumps(steps))
    return summary
