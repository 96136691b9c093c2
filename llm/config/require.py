"""The one-line refusals the groups' ``__post_init__`` checks share."""

from __future__ import annotations

from llm.errors import ConfigError


def require_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{owner}.{name}={value} must be > 0; set a positive value")


def require_choice(owner: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(
            f"{owner}.{name}={value!r} is unknown; choose one of {', '.join(choices)}"
        )
