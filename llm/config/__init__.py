"""The typed configuration: one dataclass per Hydra config group (a module per group, as
conf/ is split), the root Config, their registration and their one-group checks
(``__post_init__``). Imports llm.errors only; cross-group checks are llm/validate/.

Everything a caller needs is exported here: ``from llm.config import Config, ...``."""

from llm.config.attention import SDPA_KERNELS, AttentionConfig
from llm.config.checkpoint import CheckpointConfig
from llm.config.data import DataConfig
from llm.config.estimate import EstimateConfig
from llm.config.generate import GenerateConfig
from llm.config.keys import first_unknown_part, unknown_key_message, unknown_keys
from llm.config.launcher import LauncherConfig
from llm.config.logger import LoggerConfig
from llm.config.model import ModelConfig, MoEConfig
from llm.config.monitor import MonitorConfig
from llm.config.optimizer import OptimizerConfig
from llm.config.parallelism import (
    PP_SCHEDULES,
    PP_SINGLE_STAGE,
    PP_V_SHAPED,
    STRATEGY_NAMES,
    ParallelismConfig,
    pp_schedule_problem,
)
from llm.config.precision import LOSS_SCALER_PRESETS, PrecisionConfig
from llm.config.recompute import RECOMPUTE_NAMES, RecomputeConfig
from llm.config.rehearse import RehearseConfig
from llm.config.root import GROUPS, Config
from llm.config.scheduler import SchedulerConfig
from llm.config.store import register_configs, to_dataclass
from llm.config.train import COMPILE_MODES, FUSED_LOSSES, TrainConfig

__all__ = [
    "COMPILE_MODES",
    "FUSED_LOSSES",
    "GROUPS",
    "LOSS_SCALER_PRESETS",
    "PP_SCHEDULES",
    "PP_SINGLE_STAGE",
    "PP_V_SHAPED",
    "RECOMPUTE_NAMES",
    "SDPA_KERNELS",
    "STRATEGY_NAMES",
    "AttentionConfig",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EstimateConfig",
    "GenerateConfig",
    "LauncherConfig",
    "LoggerConfig",
    "MoEConfig",
    "ModelConfig",
    "MonitorConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "PrecisionConfig",
    "RecomputeConfig",
    "RehearseConfig",
    "SchedulerConfig",
    "TrainConfig",
    "first_unknown_part",
    "pp_schedule_problem",
    "register_configs",
    "to_dataclass",
    "unknown_key_message",
    "unknown_keys",
]
