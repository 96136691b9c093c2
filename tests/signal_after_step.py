"""`python tests/signal_after_step.py ARGS`: train.py ARGS, with SIGTERM sent from inside the
run at a known moment, for tests/test_stop_latency.py.

Rank 0 sends SIGTERM to the process that owns the run (train.py's: the launcher of spawned
ranks, as Slurm or a person would signal it, or the one rank itself) right after step
SIGNAL_AFTER_STEP returns, or as the first evaluation begins with SIGNAL_IN_EVAL=1. Every
rank writes, beside the run's files, the step after which it first saw its own stop flag
(``signal_seen_rank{N}``): the moment its stop is measured from. Spawned ranks run this
file's top level too (the spawn start method imports the main script, which stays this
file: train.py is loaded as a module), so the wrappers reach them.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from llm.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
_train_step, _evaluate = Trainer.train_step, Trainer.evaluate


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _signal_the_run() -> None:
    if _rank() == 0:
        os.kill(int(os.environ["SIGNAL_TARGET_PID"]), signal.SIGTERM)


def train_step(self, timer, stop):
    out = _train_step(self, timer, stop)
    if os.environ.get("SIGNAL_AFTER_STEP") == str(out.step):
        _signal_the_run()
    seen = Path(self.cfg.output_dir) / f"signal_seen_rank{_rank()}"
    if stop.requested and not seen.exists():
        seen.write_text(str(out.step))
    return out


def evaluate(self, stop=None):
    if os.environ.get("SIGNAL_IN_EVAL") == "1":
        os.environ["SIGNAL_IN_EVAL"] = "sent"
        _signal_the_run()
    return _evaluate(self, stop)


Trainer.train_step, Trainer.evaluate = train_step, evaluate

if __name__ == "__main__":
    os.environ["SIGNAL_TARGET_PID"] = str(os.getpid())  # inherited by spawned ranks
    # train.py as a module, so that this file stays __main__ (what spawned ranks import).
    spec = importlib.util.spec_from_file_location("train_entry", REPO / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    sys.exit(train.cli(sys.argv[1:]))
