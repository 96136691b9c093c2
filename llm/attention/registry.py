"""The backend registry and the one public entry point, :func:`attention`.

A backend offers one or more kernels (only sdpa has several: ``attention.sdpa_kernel``).
Each kernel is a function ``fn(q, k, v, *, causal, dropout_p, scale, docs) -> out`` with
what it supports per device type and, for optional packages, why it is unavailable here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from llm.attention import eager, flash_attn_backend, flex, sdpa, triton_backend, xformers_backend
from llm.attention.documents import Documents
from llm.attention.support import Supports, check_support
from llm.errors import ConfigError
from llm.memory import saved_as

Kernel = Callable[..., Tensor]


def _always() -> str | None:
    return None


@dataclass(frozen=True)
class AttentionKernel:
    fn: Kernel
    support: Callable[[], Supports]  # device type -> Support; a call, as triton's is lazy
    unavailable: Callable[[], str | None] = _always  # None, or one line: why not + the fix


def _fixed(supports: Supports) -> Callable[[], Supports]:
    return lambda: supports


BACKENDS: dict[str, dict[str, AttentionKernel]] = {
    "eager": {"auto": AttentionKernel(eager.eager, _fixed(eager.SUPPORT))},
    "sdpa": {
        name: AttentionKernel(partial(sdpa.sdpa, kernel=name), _fixed(s))
        for name, s in sdpa.SUPPORT.items()
    },
    "flash_attn": {
        "auto": AttentionKernel(
            flash_attn_backend.flash_attn,
            _fixed(flash_attn_backend.SUPPORT),
            flash_attn_backend.unavailable,
        )
    },
    "flex": {"auto": AttentionKernel(flex.flex, _fixed(flex.SUPPORT))},
    "triton": {
        "auto": AttentionKernel(
            triton_backend.triton, triton_backend.support, triton_backend.unavailable
        )
    },
    "xformers": {
        "auto": AttentionKernel(
            xformers_backend.xformers,
            _fixed(xformers_backend.SUPPORT),
            xformers_backend.unavailable,
        )
    },
}


def register_backend(name: str, kernels: dict[str, AttentionKernel]) -> None:
    """Add (or replace) a backend and its kernels ("auto" at least)."""
    BACKENDS[name] = kernels


def get_kernel(backend: str, kernel: str = "auto") -> AttentionKernel:
    if backend not in BACKENDS:
        raise ConfigError(
            f"attention.backend={backend!r} is unknown; choose one of {', '.join(BACKENDS)}"
        )
    kernels = BACKENDS[backend]
    if kernel not in kernels:
        if backend == "sdpa":
            raise ConfigError(
                f"attention.sdpa_kernel={kernel!r} is unknown; choose one of {', '.join(kernels)}"
            )
        raise ConfigError(
            f"attention.sdpa_kernel={kernel!r} applies to attention=sdpa only; set it to auto"
        )
    return kernels[kernel]


def kernel_name(backend: str, kernel: str) -> str:
    return f"attention={backend}" + ("" if kernel == "auto" else f" sdpa_kernel={kernel}")


def check_kernel(
    backend: str,
    kernel: str = "auto",
    *,
    device: str,
    dtype: torch.dtype,
    head_dim: int,
    gqa: bool,
    dropout: bool,
    document_mask: bool,
    training: bool,
) -> None:
    """One ConfigError if this kernel is missing here or cannot run this; before ranks start."""
    entry = get_kernel(backend, kernel)
    if (why := entry.unavailable()) is not None:
        raise ConfigError(why)
    check_support(
        kernel_name(backend, kernel),
        entry.support(),
        device=device,
        dtype=dtype,
        head_dim=head_dim,
        gqa=gqa,
        dropout=dropout,
        document_mask=document_mask,
        training=training,
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    backend: str = "sdpa",
    dropout_p: float = 0.0,
    scale: float | None = None,
    docs: Documents | None = None,
    kernel: str = "auto",
) -> Tensor:
    """Scaled dot-product attention, softmax scale ``scale`` (default 1/sqrt(D)).

    q: (B, H, T, D); k, v: (B, Hkv, T, D) with H % Hkv == 0. Returns (B, H, T, D).
    ``dropout_p`` is applied to the attention probabilities; callers pass 0.0 in eval mode.
    ``docs``: packed documents to keep apart (attention.document_mask). ``kernel``: which of
    the backend's kernels (attention.sdpa_kernel; "auto" for every other backend).
    What the kernel saves for backward is labelled "attention" for the memory counters.
    """
    if q.size(1) % k.size(1) != 0 or k.shape != v.shape:
        raise ConfigError(
            f"attention got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
            "k and v must match and their head count must divide q's"
        )
    fn = get_kernel(backend, kernel).fn
    scale = q.size(-1) ** -0.5 if scale is None else scale
    with saved_as("attention"):
        return fn(q, k, v, causal=causal, dropout_p=dropout_p, scale=scale, docs=docs)
