"""A pipeline schedule's step as torch runs it: each rank's forwards and backwards in order,
from which the micro-batches a rank holds at its peak follow, and the step played out over
all ranks with unit costs, from which the bubble follows.

gpipe and 1f1b have closed forms (Narayanan et al. 2021, section 2.2.1): every micro-batch
in flight under gpipe, p - r on rank r under 1f1b, and a bubble of (p - 1)/(m + p - 1).
The multi-stage schedules run a list of actions per rank that torch computes when the
schedule is built (``pipeline_order``); it is read from schedules built over stand-in
stages, which is all the list depends on: stage indices and counts. So the estimate follows
torch's own schedules, the zero-bubble ones included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from operator import mul
from types import SimpleNamespace
from typing import NamedTuple

import torch

from llm.config import PP_SINGLE_STAGE
from llm.parallel.pipeline import SCHEDULES, PipelineLayout

# Action kinds: a forward, a full backward, the input-gradient and the weight-gradient halves
# of a split backward (zero-bubble). Autograd keeps a micro-batch's saved tensors until its
# weight gradients are taken (torch's ``stage_backward_input`` retains the graph), the stage
# output only until its input gradient.
FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "B", "I", "W"
# Time of each kind for one stage and micro-batch: a backward costs two forwards, each half
# of a split backward one (Qi et al. 2023, section 2).
COST = {FORWARD: 1, BACKWARD: 2, INPUT_GRAD: 1, WEIGHT_GRAD: 1}


class Action(NamedTuple):
    stage: int
    kind: str
    microbatch: int


@dataclass(frozen=True)
class InFlight:
    """Per local stage of a rank (in ``PipelineLayout.stages_of`` order): micro-batches whose
    weight gradients are still to come (autograd holds their saved tensors), and those whose
    input gradients are (torch caches their stage output)."""

    saved: tuple[int, ...]
    outputs: tuple[int, ...]


def _stand_in_stages(layout: PipelineLayout) -> list[SimpleNamespace]:
    n = layout.n_stages
    return [
        SimpleNamespace(
            stage_index=s,
            num_stages=n,
            group_size=layout.pp_size,
            group_rank=0,
            is_first=s == 0,
            is_last=s == n - 1,
            submod=torch.nn.Module(),
        )
        for s in layout.stages_of(0)
    ]


def _actions(torch_actions) -> list[Action]:
    """torch's compute actions in order; an overlapped pair (DualPipeV) as its forward, then
    its backward."""
    out = []
    for a in torch_actions:
        if a is None:
            continue
        for sub in a.sub_actions or (a,):
            kind = sub.computation_type.value
            if kind in COST:
                out.append(Action(sub.stage_index, kind, sub.microbatch_index))
    return out


def _skip_lowering(self, actions, format="compute_only") -> None:
    """Stands in for torch's lowering of the order to communication actions, which running
    needs and the order does not (it takes minutes at thousands of micro-batches); the
    lowering adds actions around the compute ones without moving them."""


@cache
def rank_orders(schedule: str, p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """Every pipeline rank's compute actions for one step under a multi-stage schedule, in
    the order it runs them."""
    if schedule in PP_SINGLE_STAGE:
        raise ValueError(f"{schedule} runs a loop, not a list of actions: use its closed form")
    layout = PipelineLayout(p * v, p, v, schedule)
    order_only = type(
        schedule, (SCHEDULES[schedule],), {"_prepare_schedule_with_comms": _skip_lowering}
    )
    built = order_only(_stand_in_stages(layout), m, loss_fn=torch.add)
    return tuple(tuple(_actions(built.pipeline_order[r])) for r in range(p))


def rank_states(schedule: str, p: int, m: int, v: int, pp_rank: int) -> list[InFlight]:
    """What rank ``pp_rank`` holds right after each of its forwards (where its totals rise)
    under a multi-stage schedule."""
    stages = PipelineLayout(p * v, p, v, schedule).stages_of(pp_rank)
    saved, outputs = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0)
    states = []
    for a in rank_orders(schedule, p, m, v)[pp_rank]:
        if a.kind == FORWARD:
            saved[a.stage] += 1
            outputs[a.stage] += 1
            states.append(InFlight(tuple(saved.values()), tuple(outputs.values())))
        if a.kind in (BACKWARD, WEIGHT_GRAD):
            saved[a.stage] -= 1
        if a.kind in (BACKWARD, INPUT_GRAD):
            outputs[a.stage] -= 1
    return states


def step_time(schedule: str, p: int, m: int, v: int) -> int:
    """The step played out with ``COST`` per action and free communication: each rank runs
    its actions in order, each as soon as the rank is free and its inputs exist (the previous
    stage's forward, the next stage's input gradient, its own forward before its backward).
    Returns when the last rank finishes."""
    orders = rank_orders(schedule, p, m, v)
    n_stages = p * v
    finished: dict[tuple[int, str, int], int] = {}
    clock, position = [0] * p, [0] * p
    while any(position[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(orders[r]):
                a = orders[r][position[r]]
                needs = _inputs(a, n_stages)
                ready = [finished.get(n) for n in needs]
                if None in ready:
                    break
                clock[r] = max([clock[r], *ready]) + COST[a.kind]
                finished[(a.stage, a.kind, a.microbatch)] = clock[r]
                if a.kind == BACKWARD:  # a full backward also yields the input gradient
                    finished[(a.stage, INPUT_GRAD, a.microbatch)] = clock[r]
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {schedule} stalls at p={p}, m={m}, v={v}")
    return max(clock)


def _inputs(a: Action, n_stages: int) -> list[tuple[int, str, int]]:
    if a.kind == FORWARD:
        return [(a.stage - 1, FORWARD, a.microbatch)] if a.stage > 0 else []
    if a.kind == WEIGHT_GRAD:
        return [(a.stage, INPUT_GRAD, a.microbatch)]
    needs = [(a.stage, FORWARD, a.microbatch)]
    if a.stage < n_stages - 1:
        needs.append((a.stage + 1, INPUT_GRAD, a.microbatch))
    return needs


def bubble_share(schedule: str, p: int, m: int, v: int) -> float:
    """The share of the step a rank idles: 1 - (its busy time) / (the step time). Every rank
    does the same work: 3 units per micro-batch and stage, v stages."""
    if p == 1:
        return 0.0
    if schedule in PP_SINGLE_STAGE:
        return (p - 1) / (m + p - 1)
    return 1 - 3 * m * v / step_time(schedule, p, m, v)


def peak_state(
    schedule: str,
    p: int,
    m: int,
    v: int,
    pp_rank: int,
    until_weight: Sequence[int] | None = None,
    until_input: Sequence[int] | None = None,
) -> InFlight:
    """What rank ``pp_rank`` holds when it holds the most bytes, given the bytes one
    micro-batch keeps on each of its stages until its weight gradients and until its input
    gradients (by default one unit until the weight gradients: the most micro-batches). Without a pipeline one micro-batch
    (gradient accumulation runs them one at a time). The first of equal states."""
    if p == 1:
        return InFlight((1,), (1,))
    if schedule in PP_SINGLE_STAGE:
        n = m if schedule == "gpipe" else min(m, p - pp_rank)
        return InFlight((n,), (n,))
    until_weight = until_weight or [1] * v
    until_input = until_input or [0] * v

    def held(state: InFlight) -> int:
        return sum(map(mul, state.saved, until_weight)) + sum(map(mul, state.outputs, until_input))

    return max(rank_states(schedule, p, m, v, pp_rank), key=held)
