"""Parallelism applied from outside the model: process groups and the rank a launcher hands
over (dist.py), the mesh, and one strategy per option.

May import llm.models, llm.optim, llm.precision, llm.memory, llm.config and llm.errors."""

from llm.parallel.mesh import ParallelDims
from llm.parallel.strategy import STRATEGIES, StepResult, Strategy, build_strategy

__all__ = ["STRATEGIES", "ParallelDims", "StepResult", "Strategy", "build_strategy"]
