"""Probe steps and timed steps: a training step runs the instruments or is timed, never both.

The instruments cost time at every op or saved tensor: the peak tracker (a dispatch mode
and a patched ``UntypedStorage.resize_``), the saved-tensor counter of activation bytes,
fp8's quantisation statistics and the walk over the model state's storages. Eager attention
and runs without recompute save the most tensors, so they would pay the most, which is
exactly what the timing experiments compare. So each step is one of two kinds:

- a probe runs every instrument the run asks for; its time is never reported;
- a timed step runs none; only timed steps give step_time_s, tokens/s, MFU and the data
  wait, in metrics.jsonl and summary.json.

Which steps probe (``train.memory_tracking``):
- ``logged`` (default) and ``off``: step 1 and the logged steps (every ``train.log_every``-th
  and the last); ``off`` runs every instrument but the peak tracker there;
- ``alternate``: every other step.
A step right after a probe is timed even when it is logged (``log_every=1`` alternates), so
a run always has timed steps, except where precision.fp8_stats_every=1 records every step.
Every step that precision.fp8_stats_every records is a probe.

The schedule is a function of the step number alone, so a resumed run probes the same steps
as one that never stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProbeSchedule:
    mode: str  # train.memory_tracking
    log_every: int
    last_step: int  # train.stop_at_step or train.max_steps: always logged
    fp8_every: int = 0  # precision.fp8_stats_every where the run has fp8 linears to record
    # _probe[s - 1]: whether step s probes, filled forward from step 1 as steps are asked.
    _probe: list[bool] = field(default_factory=list, repr=False)

    def logs(self, step: int) -> bool:
        """Steps whose metrics are logged: the first, every log_every-th and the last."""
        return step == 1 or step % self.log_every == 0 or step == self.last_step

    def records_fp8(self, step: int) -> bool:
        return self.fp8_every > 0 and step % self.fp8_every == 0

    def probes(self, step: int) -> bool:
        """Whether ``step`` runs the instruments (and so is not timed)."""
        while len(self._probe) < step:
            s = len(self._probe) + 1
            forced = s == 1 or self.records_fp8(s)
            wanted = self.mode == "alternate" or self.logs(s)
            self._probe.append(forced or (wanted and not self._probe[-1]))
        return self._probe[step - 1]
