"""The stop vote, read at every step boundary without waiting for the device.

A signal sets a flag on the host of the rank it reached (llm.train.stop). With one rank
that flag is the vote: the loop reads it after every step, and no collective is needed.
With more, every rank must stop at the same step, so the vote is the step's all-reduced
count of ranks asked to stop (the Trainer's first collective of a step carries it):

- on the CPU (gloo) the all-reduce has finished when it returns, so the step reads its own
  vote;
- on a GPU the sum is still in the stream: each step copies it to pinned host memory
  (non-blocking) behind an event, and reads the copy the step before made, waiting on that
  event only; by then the host has queued the next step, so the device stays busy, and the
  host runs at most one step ahead of the device.

So a signal that arrives while step k runs is acted on after step k on one rank, after
step k + 1 on CPU ranks (the vote rides in step k + 1's collective when step k's had gone),
and after step k + 2 on GPU ranks. ``StopVote.of_batch`` does the same per batch of an
evaluation, with an all-reduce of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class StopVote:
    """``seen(votes, requested)`` after each step (or batch): whether every rank stops now.
    One object per sequence of reads: its GPU copy of a vote is read by the next call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.multi_rank = dist.is_initialized() and dist.get_world_size() > 1
        self._slots: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        self._posted = 0

    def seen(self, votes: torch.Tensor | None, requested: bool) -> bool:
        """``votes``: the all-reduced count of ranks asked to stop (on the device), used when
        there are several ranks; ``requested``: this rank's own flag."""
        if not self.multi_rank:
            return requested
        if self.device.type != "cuda":
            return votes.item() > 0  # gloo's sum is on the host and complete
        return self._one_step_late(votes)

    def of_batch(self, requested: bool) -> bool:
        """The same for a loop with no collective of its own to carry the vote (an
        evaluation): one all-reduce of the flag per call, where there are several ranks."""
        if not self.multi_rank:
            return requested
        votes = torch.full((), float(requested), dtype=torch.float64, device=self.device)
        dist.all_reduce(votes)
        return self.seen(votes, requested)

    def _one_step_late(self, votes: torch.Tensor) -> bool:
        if not self._slots:
            self._slots = [torch.zeros((), dtype=torch.float64).pin_memory() for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)]
        slot = self._posted % 2
        self._slots[slot].copy_(votes.detach().reshape(()), non_blocking=True)
        self._events[slot].record()
        self._posted += 1
        if self._posted == 1:
            return False
        before = 1 - slot  # written by the previous call; read once its copy is done
        self._events[before].synchronize()
        return self._slots[before].item() > 0
