"""The root schema: one field per config group, and the groups that have a conf/ folder."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm.config.attention import AttentionConfig
from llm.config.checkpoint import CheckpointConfig
from llm.config.data import DataConfig
from llm.config.estimate import EstimateConfig
from llm.config.generate import GenerateConfig
from llm.config.launcher import LauncherConfig
from llm.config.logger import LoggerConfig
from llm.config.model import ModelConfig
from llm.config.monitor import MonitorConfig
from llm.config.optimizer import OptimizerConfig
from llm.config.parallelism import ParallelismConfig
from llm.config.precision import PrecisionConfig
from llm.config.recompute import RecomputeConfig
from llm.config.rehearse import RehearseConfig
from llm.config.scheduler import SchedulerConfig
from llm.config.train import TrainConfig


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    estimate: EstimateConfig = field(default_factory=EstimateConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    rehearse: RehearseConfig = field(default_factory=RehearseConfig)
    output_dir: str = "outputs/run"  # conf/config.yaml points it at Hydra's run directory
    sweep_name: str | None = None  # set by train.py under -m: the W&B group


GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "attention": AttentionConfig,
    "parallelism": ParallelismConfig,
    "precision": PrecisionConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "data": DataConfig,
    "recompute": RecomputeConfig,
    "logger": LoggerConfig,
    "monitor": MonitorConfig,
    "launcher": LauncherConfig,
}
