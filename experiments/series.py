"""What several reports read off a job's logged series: a trailing mean of a metric, and
the median step time after the warm-up steps."""

from __future__ import annotations

import statistics

from experiments.sweep import Job


def smoothed(rows: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """The trailing mean of ``window`` logged values, from the ``window``-th on."""
    return [
        (rows[i][0], statistics.mean(v for _, v in rows[i - window + 1 : i + 1]))
        for i in range(window - 1, len(rows))
    ]


def median_step_time(job: Job, warmup_steps: int) -> float | None:
    """The median ``step_time_s`` over the steps after ``warmup_steps``; None where none was
    logged. Steps that ran an instrument (a probe, fp8 statistics) carry no step time."""
    times = [t for s, t in job.metric("step_time_s") if s > warmup_steps]
    return statistics.median(times) if times else None
