"""A rank's main for tests/test_host_reads.py: llm.run.main with the host reads of every
step that is neither logged nor a probe counted (benchmarks/profile_step's counter) and
written to the run directory as host_reads_rank{N}.json, with whether the optimizer's param
groups are fused. Spawned ranks import it by name,
so it lives in a module of its own; a monkeypatch in the test process would not reach them.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.profile_step.host_reads import HostReads
from llm import run
from llm.parallel.dist import RankEnv
from llm.train.trainer import Trainer


def counted_main(cfg, env: RankEnv) -> dict:
    """Count around ``Trainer.train_step`` and ``Trainer._account``: what the loop runs for
    a step that is not read (``_read_pending`` runs on logged steps only). Also writes
    whether each of the optimizer's param groups is fused."""
    counts: dict[int, list[dict]] = {}
    fused: list = []
    train_step, account = Trainer.train_step, Trainer._account

    def counted_step(self, timer, stop):
        step = self.state.step + 1
        if self.probes.logs(step) or self.probes.probes(step):
            return train_step(self, timer, stop)
        with HostReads() as reads:
            out = train_step(self, timer, stop)
            account(self, out)
        counts[step] = reads.rows(1)
        fused[:] = [g.get("fused") for g in self.strategy.optimizer.param_groups]
        return out

    def counted_account(self, step):
        if step.step not in counts:  # a counted step was accounted inside the counter
            account(self, step)

    Trainer.train_step, Trainer._account = counted_step, counted_account
    try:
        summary = run.main(cfg, env)
    finally:
        Trainer.train_step, Trainer._account = train_step, account
    written = {"reads": counts, "fused": fused}
    Path(cfg.output_dir, f"host_reads_rank{env.rank}.json").write_text(json.dumps(written))
    return summary
