"""Frozen parameters (``model.freeze``): globs over parameter names, matched with fnmatch.

A frozen parameter has ``requires_grad=False`` before any strategy wraps the model, so it
gets no gradient, the optimizer factory leaves it out of every param group (no optimizer
state, no update), and the strategies' accounting shows the saving.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from llm.errors import ConfigError


def freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """Set ``requires_grad=False`` on every parameter whose name matches one of
    ``patterns``; return the frozen names. A pattern that matches nothing is a ConfigError
    (a typo would otherwise train what was meant to be frozen)."""
    names = [name for name, _ in model.named_parameters()]  # a tied weight once, by first name
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name in names):
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise ConfigError(
                f"model.freeze pattern {pattern!r} matches no parameter; parameter names "
                f"look like {shown}"
            )
    frozen = []
    for name, param in model.named_parameters():
        if any(fnmatchcase(name, pattern) for pattern in patterns):
            param.requires_grad_(False)
            frozen.append(name)
    return frozen
