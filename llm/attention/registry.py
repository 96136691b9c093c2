"""The backend registry and the one public entry point, :func:`attention`."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from llm.attention.eager import eager
from llm.attention.sdpa import sdpa
from llm.errors import ConfigError

# A backend: fn(q, k, v, *, causal, dropout_p) -> out, shapes as in the package docstring.
Backend = Callable[..., Tensor]

BACKENDS: dict[str, Backend] = {"eager": eager, "sdpa": sdpa}


def register_backend(name: str, fn: Backend) -> None:
    """Add (or replace) a backend; optional ones register themselves when their package imports."""
    BACKENDS[name] = fn


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError(
            f"attention.backend={name!r} is unknown; choose one of {', '.join(BACKENDS)}"
        ) from None


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    backend: str = "sdpa",
    dropout_p: float = 0.0,
) -> Tensor:
    """Scaled dot-product attention with softmax scale 1/sqrt(D).

    q: (B, H, T, D); k, v: (B, Hkv, T, D) with H % Hkv == 0. Returns (B, H, T, D).
    ``dropout_p`` is applied to the attention probabilities; callers pass 0.0 in eval mode.
    """
    if q.size(1) % k.size(1) != 0 or k.shape != v.shape:
        raise ConfigError(
            f"attention got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
            "k and v must match and their head count must divide q's"
        )
    return get_backend(backend)(q, k, v, causal=causal, dropout_p=dropout_p)
