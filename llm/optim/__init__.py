"""Optimizers by name (a registry later issues extend) and learning-rate schedules."""

from llm.optim.factory import (
    OPTIMIZERS,
    build_optimizer,
    optimizer_for_groups,
    param_groups,
    register_optimizer,
)
from llm.optim.lazy_state import materialize_state
from llm.optim.rounded_update import RoundedUpdate, wrap_optimizer
from llm.optim.schedule import (
    SCHEDULES,
    build_scheduler,
    clamped_warmup,
    lr_multiplier,
    warmup_note,
)

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "RoundedUpdate",
    "build_optimizer",
    "build_scheduler",
    "clamped_warmup",
    "lr_multiplier",
    "materialize_state",
    "optimizer_for_groups",
    "param_groups",
    "register_optimizer",
    "warmup_note",
    "wrap_optimizer",
]
