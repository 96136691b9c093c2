"""Which blocks each pipeline stage holds, which stages each pipeline rank runs, and what a
schedule needs of the micro-batches: plain arithmetic, checked before any rank starts."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from llm.config import PP_V_SHAPED, ParallelismConfig
from llm.errors import ConfigError


@dataclass(frozen=True)
class PipelineLayout:
    n_layers: int
    pp_size: int
    virtual_stages: int  # stages per rank
    schedule: str
    split: tuple[int, ...] | None = None  # first block of stages 1..n_stages-1

    @classmethod
    def from_config(cls, p: ParallelismConfig, n_layers: int) -> PipelineLayout:
        split = None if p.pp_split is None else tuple(p.pp_split)
        return cls(n_layers, p.pp_size, p.pp_virtual_stages, p.pp_schedule, split)

    @property
    def n_stages(self) -> int:
        return self.pp_size * self.virtual_stages

    def stage_blocks(self) -> list[range]:
        """The blocks of each stage. Balanced: n_layers // n_stages each, the remainder one
        more each on the first stages (the last stage also runs the LM head, the heaviest
        layer of a small model)."""
        if self.split is not None:
            bounds = (0, *self.split, self.n_layers)
            return [range(a, b) for a, b in itertools.pairwise(bounds)]
        base, extra = divmod(self.n_layers, self.n_stages)
        sizes = [base + (s < extra) for s in range(self.n_stages)]
        starts = [sum(sizes[:s]) for s in range(self.n_stages)]
        return [range(a, a + n) for a, n in zip(starts, sizes, strict=True)]

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        """Stage indices pipeline rank ``pp_rank`` runs, in order: looped (r, r+p, ...) or,
        for the V-shaped schedules, (r, 2p-1-r)."""
        if self.schedule in PP_V_SHAPED:
            return (pp_rank, self.n_stages - 1 - pp_rank)
        return tuple(pp_rank + k * self.pp_size for k in range(self.virtual_stages))


def check_layout(p: ParallelismConfig, n_layers: int, micro_batch_size: int) -> None:
    """What a pipeline needs of the model and the batch, from llm.validate."""
    if p.pp_size == 1:
        return
    stages = p.pp_size * p.pp_virtual_stages
    if n_layers < stages:
        raise ConfigError(
            f"model.n_layers={n_layers} is fewer than the {stages} pipeline stages (pp_size x "
            "pp_virtual_stages); lower pp_size or pp_virtual_stages"
        )
    m = p.microbatches
    if micro_batch_size % m:
        raise ConfigError(
            f"train.micro_batch_size={micro_batch_size} is not divisible by the "
            f"{m} pipeline micro-batches; set parallelism.pp_microbatches to a divisor of it"
        )
    if p.pp_split is not None:
        split = list(p.pp_split)
        if (
            len(split) != stages - 1
            or split != sorted(set(split))
            or not (split[0] > 0 and split[-1] < n_layers)
        ):
            raise ConfigError(
                f"parallelism.pp_split={split} must name {stages - 1} increasing block indices "
                f"in 1..{n_layers - 1} (the first block of stages 1..{stages - 1})"
            )
