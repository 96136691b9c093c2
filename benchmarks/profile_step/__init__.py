"""Where a training step's time goes: ``python -m benchmarks.profile_step [overrides]``.

Takes train.py's Hydra overrides (any model, strategy on one rank, precision, attention;
CPU or GPU), runs warm-up steps, then steps under torch.profiler, then as many steps with
host reads counted (run.py says why apart), and writes under ``--out`` (default
outputs/profile_step/<model>-<strategy>-<precision>-<attention>):
- report.md (printed too): the top 20 ops (CPU self time) or kernels (GPU time) with their
  share of the profiled steps' wall time; that time split into categories (rules.py); the
  host reads on the step's path, each with the line of this repository that made it;
- profile.json: the same figures; trace.json: a Chrome trace; key_averages.txt: the
  profiler's table.
Profiled steps are instrumented: the step time printed is labelled as under the profiler,
never a tokens/s.
"""

from __future__ import annotations

from pathlib import Path

from .report import figures, write
from .run import Plan, profile_run


def profile_step(
    overrides: list[str],
    out: Path | None = None,
    warmup: int = 2,
    steps: int = 3,
    record_shapes: bool = False,
) -> tuple[Path, str]:
    """Profile one run of ``overrides``; returns (the output folder, the report)."""
    out, windows, summary = profile_run(overrides, Plan(warmup, steps), out, record_shapes)
    return out, write(out, windows, figures(windows, overrides, summary))
