"""A stand-in rank main for tests/test_train_log.py: each rank logs a warning as a module
logger does, and rank 0 says a console line as the RunLogger does. Spawned ranks import it
by name, so it lives in a module of its own, with nothing heavy to import."""

from __future__ import annotations

import logging
from pathlib import Path

from llm.logging import say


def logs_a_line_per_rank(cfg, env) -> dict:
    logging.getLogger("llm.stand_in").warning("rank %d's warning", env.rank)
    if env.rank == 0:
        say("rank 0's console line")
        (Path(cfg.output_dir) / "summary.json").write_text("{}")  # what the launcher reads
    return {}
