"""Keys the schema does not declare: found at any depth, refused, and named with the
closest declared key."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from llm.config.root import Config
from llm.errors import ConfigError


def unknown_keys(node: Any, schema: type, prefix: str = "") -> list[str]:
    """Dotted keys of ``node`` (a DictConfig or dict) that ``schema`` does not declare, at
    any depth of nested dataclasses."""
    hints = typing.get_type_hints(schema)
    found = []
    for key in node:
        name = f"{prefix}{key}"
        if key not in hints:
            found.append(name)
        elif dataclasses.is_dataclass(hints[key]) and hasattr(node[key], "keys"):
            found.extend(unknown_keys(node[key], hints[key], f"{name}."))
    return found


def refuse_unknown_keys(cfg: Any) -> None:
    # Hydra's `+key=value` adds a key to a typed node, and OmegaConf.to_object keeps it as
    # a stray attribute: a typo like +train.max_stepz=5 would be silently ignored.
    unknown = unknown_keys(cfg, Config)
    if not unknown:
        return
    raise ConfigError(unknown_key_message(unknown[0]))


def unknown_key_message(key: str) -> str:
    """One line for a dotted ``key`` whose last part its parent's schema does not declare:
    the closest declared key, and the parent's keys."""
    parent, _, leaf = key.rpartition(".")
    schema = Config
    for part in filter(None, parent.split(".")):
        schema = typing.get_type_hints(schema)[part]
    known = [f.name for f in dataclasses.fields(schema)]
    close = difflib.get_close_matches(leaf, known, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""
    return (
        f"{key} is not a config key; {hint}remove it or fix its name "
        f"(keys of {parent or 'the root'}: {', '.join(known)})"
    )


def first_unknown_part(key: str) -> str | None:
    """The prefix of dotted ``key`` up to its first part the schema does not declare, or
    None when every part down to a non-dataclass field (a dict, a list, a value) exists."""
    schema: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(schema)
        if part not in hints:
            return ".".join(parts[: i + 1])
        schema = hints[part]
        if not dataclasses.is_dataclass(schema):
            return None
    return None
