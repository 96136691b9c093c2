"""The schemas registered with Hydra's ConfigStore, and a composed config turned into a
checked Config."""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from llm.config.keys import refuse_unknown_keys
from llm.config.root import GROUPS, Config


def register_configs() -> None:
    """Register the root schema and one schema per group, so every YAML is type-checked.

    Group schemas sit at the top level (``/model_schema``, pulled in by each option's
    defaults as ``/model_schema@_here_``), not inside their group: there Hydra would offer
    ``model=model_schema`` as an option, which runs the dataclass defaults."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, schema in GROUPS.items():
        cs.store(name=f"{group}_schema", node=schema)


def to_dataclass(cfg: Any) -> Config:
    """Turn a resolved DictConfig into a Config; unknown keys are refused and the
    __post_init__ checks run here."""
    refuse_unknown_keys(cfg)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg))
