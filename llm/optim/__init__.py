"""Optimizers by name (a registry with each one's state declaration and the layout it needs
of sharded parameters), our LAMB / Lion / Sophia, wrappers, and learning-rate schedules.

May import llm.config, llm.data and llm.errors."""

from llm.optim import builders as _builders  # noqa: F401  (registers every optimizer)
from llm.optim.factory import (
    build_optimizer,
    optimizer_for_groups,
    optimizer_param_groups,
    param_groups,
)
from llm.optim.gradient_pass import GradientPass, gradient_pass, sampled_labels
from llm.optim.lamb import Lamb
from llm.optim.lazy_state import materialize_state
from llm.optim.lion import Lion
from llm.optim.registry import (
    ELEMENTWISE,
    OPTIMIZERS,
    PARAM_NORMS,
    QUANT_BLOCKS,
    WHOLE_MATRICES,
    OptimizerSpec,
    declared_bytes_per_parameter,
    declared_state_bytes,
    pieces_state_bytes,
    register_optimizer,
)
from llm.optim.rounded_update import RoundedUpdate, wrap_optimizer
from llm.optim.schedule import (
    SCHEDULES,
    build_scheduler,
    clamped_warmup,
    lr_multiplier,
    warmup_note,
)
from llm.optim.shard_layout import ParamLayout, ShardLayout
from llm.optim.sophia import SophiaG

__all__ = [
    "ELEMENTWISE",
    "OPTIMIZERS",
    "PARAM_NORMS",
    "QUANT_BLOCKS",
    "SCHEDULES",
    "WHOLE_MATRICES",
    "GradientPass",
    "Lamb",
    "Lion",
    "OptimizerSpec",
    "ParamLayout",
    "RoundedUpdate",
    "ShardLayout",
    "SophiaG",
    "build_optimizer",
    "build_scheduler",
    "clamped_warmup",
    "declared_bytes_per_parameter",
    "declared_state_bytes",
    "gradient_pass",
    "lr_multiplier",
    "materialize_state",
    "optimizer_for_groups",
    "optimizer_param_groups",
    "param_groups",
    "pieces_state_bytes",
    "register_optimizer",
    "sampled_labels",
    "warmup_note",
    "wrap_optimizer",
]
