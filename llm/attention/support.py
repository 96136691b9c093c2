"""What an attention kernel supports on one device type, and the one-line refusal of the rest.

Every kernel declares a :class:`Support` per device type it runs on ("cpu", "cuda"); the
config is checked against it before any rank starts (llm/validate/), and ``attention()``
checks each call the same way, so an unsupported combination is one ConfigError naming the
problem and the fix, never a fallback to another kernel or a traceback from inside one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from llm.errors import ConfigError

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
HALVES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Support:
    """One kernel on one device type. Head dims allowed: ``head_dims`` when given, else
    min_head_dim..max_head_dim in steps of head_dim_multiple."""

    dtypes: tuple[torch.dtype, ...] = FLOATS
    head_dims: tuple[int, ...] | None = None
    min_head_dim: int = 1
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    gqa: bool = True  # fewer K/V heads than query heads, read without repeating K/V
    dropout: bool = True  # dropout on the attention probabilities
    document_mask: bool = True  # attention.document_mask=true (packed documents kept apart)
    backward: bool = True  # training; False: evaluation (no gradient) only

    def head_dim_ok(self, d: int) -> bool:
        if self.head_dims is not None:
            return d in self.head_dims
        too_big = self.max_head_dim is not None and d > self.max_head_dim
        return self.min_head_dim <= d and not too_big and d % self.head_dim_multiple == 0

    def head_dim_text(self) -> str:
        if self.head_dims is not None:
            return ", ".join(map(str, self.head_dims))
        top = "" if self.max_head_dim is None else f"..{self.max_head_dim}"
        step = "" if self.head_dim_multiple == 1 else f" in multiples of {self.head_dim_multiple}"
        return f"{self.min_head_dim}{top}{step}" if top or step else f">= {self.min_head_dim}"


Supports = Mapping[str, Support]  # device type -> what runs there


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_support(
    name: str,
    supports: Supports,
    *,
    device: str,
    dtype: torch.dtype,
    head_dim: int,
    gqa: bool,
    dropout: bool,
    document_mask: bool,
    training: bool,
) -> None:
    """Raise a one-line ConfigError if kernel ``name`` cannot run this; else return."""
    s = supports.get(device)
    if s is None:
        raise ConfigError(
            f"{name} does not run on {device} (it runs on {', '.join(supports) or 'nothing here'}); "
            "choose another attention backend or device (docs/attention.md has the table)"
        )
    if dtype not in s.dtypes:
        raise ConfigError(
            f"{name} on {device} takes {', '.join(map(_dtype_name, s.dtypes))}, not "
            f"{_dtype_name(dtype)}; pick a matching precision (e.g. precision=bf16) or another backend"
        )
    if not s.head_dim_ok(head_dim):
        raise ConfigError(
            f"{name} on {device} takes head dims {s.head_dim_text()}, not {head_dim}; change "
            "model.d_model / model.n_heads or the attention backend"
        )
    if gqa and not s.gqa:
        raise ConfigError(
            f"{name} on {device} has no grouped-query attention; use n_kv_heads = n_heads or "
            "another attention backend"
        )
    if dropout and not s.dropout:
        raise ConfigError(
            f"{name} on {device} has no attention dropout; set model.dropout=0 or use "
            "attention=eager or sdpa"
        )
    if document_mask and not s.document_mask:
        raise ConfigError(
            f"{name} on {device} cannot mask documents; set attention.document_mask=false or "
            "use attention=eager, sdpa, flex, flash_attn, xformers or triton where they run"
        )
    if training and not s.backward:
        raise ConfigError(
            f"{name} on {device} has no backward (evaluation only), so it cannot train; use "
            "attention=sdpa or eager here, or a GPU"
        )


def package_missing(option: str, package: str, error: Exception, install: str) -> str:
    """The one-line refusal of ``attention=option`` when importing ``package`` raised
    ``error``: its first line (or its type, where it has no message) and the fix."""
    why = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"attention={option} needs the {package} package ({why}); {install}"
