"""Pipeline parallelism (``parallelism.pp_size > 1``) on torch.distributed.pipelining.

``layout``: which blocks each stage holds and which stages each rank runs, and the checks
made before ranks start; ``modules``: this rank's part of the model under the whole model's
names, and the stage modules; ``tied``: a tied embedding split over the first and last
stage; ``schedule``: the schedule that runs a step's micro-batches (docs/parallel.md).
"""

from llm.parallel.pipeline.layout import PipelineLayout, check_layout
from llm.parallel.pipeline.modules import PipelinePart, Stage, part_weights
from llm.parallel.pipeline.schedule import SCHEDULES, GradSync, Pipeline

__all__ = [
    "SCHEDULES",
    "GradSync",
    "Pipeline",
    "PipelineLayout",
    "PipelinePart",
    "Stage",
    "check_layout",
    "part_weights",
]
