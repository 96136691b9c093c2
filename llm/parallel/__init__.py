"""Parallelism applied from outside the model: the mesh, and one strategy per option."""

from llm.parallel.mesh import ParallelDims
from llm.parallel.strategy import STRATEGIES, StepResult, Strategy, build_strategy

__all__ = ["STRATEGIES", "ParallelDims", "StepResult", "Strategy", "build_strategy"]
