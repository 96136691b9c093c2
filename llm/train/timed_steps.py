"""The timed steps' figures: step time, tokens/s and data wait, from steps that ran no
instrument (llm/train/probes.py), per log line and over the run."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from llm.train.metrics import StepTiming

# Steady state: the first steps carry allocator warm-up and compilation.
WARMUP_STEPS = 3


@dataclass(frozen=True)
class TimedStep:
    step: int
    tokens: float  # global target tokens of the step
    timing: StepTiming

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / self.timing.step_time_s


class TimedSteps:
    def __init__(self) -> None:
        self.steps: list[TimedStep] = []
        self._shown = 0  # steps already summarised by window()

    def add(self, step: int, tokens: float, timing: StepTiming) -> None:
        self.steps.append(TimedStep(step, tokens, timing))

    def window(self) -> dict:
        """The timed steps since the last call, for one log line: median step time and
        tokens/s, mean data-wait share, and how many steps they come from (None and 0 when
        every step since the last line probed)."""
        steps, self._shown = self.steps[self._shown :], len(self.steps)
        if not steps:
            return {
                "step_time_s": None,
                "tokens_per_sec": None,
                "data_wait_share": None,
                "timed_steps": 0,
            }
        return {
            "step_time_s": statistics.median(s.timing.step_time_s for s in steps),
            "tokens_per_sec": statistics.median(s.tokens_per_sec for s in steps),
            "data_wait_share": statistics.fmean(s.timing.data_wait_share for s in steps),
            "timed_steps": len(steps),
        }

    def last_tokens_per_sec(self) -> float | None:
        return self.steps[-1].tokens_per_sec if self.steps else None

    def steady(self) -> list[TimedStep]:
        """The timed steps after the warm-up steps, or every timed step when none is later."""
        late = [s for s in self.steps if s.step > WARMUP_STEPS]
        return late or self.steps

    def median_tokens_per_sec(self) -> float | None:
        steady = self.steady()
        return statistics.median(s.tokens_per_sec for s in steady) if steady else None

    def median_step_time_s(self) -> float | None:
        steady = self.steady()
        return statistics.median(s.timing.step_time_s for s in steady) if steady else None

    def median_data_wait_share(self) -> float | None:
        steady = self.steady()
        return statistics.median(s.timing.data_wait_share for s in steady) if steady else None
