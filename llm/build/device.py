"""The device a run trains on, from train.device and what is visible."""

from __future__ import annotations

import torch

from llm.config import Config
from llm.errors import ConfigError


def resolve_device(cfg: Config) -> torch.device:
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
    if cfg.train.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")
