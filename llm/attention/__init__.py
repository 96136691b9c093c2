"""One attention signature, several backends chosen by name (``attention.backend`` in the config).

Every backend takes q (B, H, T, D) and k, v (B, Hkv, T, D) with H % Hkv == 0 and returns
(B, H, T, D); grouped-query and multi-query attention are handled inside, so models never
repeat K/V themselves. Backends: eager (the reference), sdpa (torch's fused kernels, one
chosen by ``attention.sdpa_kernel``), flash_attn (the package), flex (FlexAttention,
compiled), triton (our FlashAttention-2 kernel) and xformers (xFormers'
memory_efficient_attention, the package). Each declares what it supports
(:mod:`llm.attention.support`); :func:`check_kernel` refuses the rest in one line.
``attention=auto`` (:func:`resolve`) picks the fastest that the committed GPU records show
and that can run here (:mod:`llm.attention.auto`).

May import llm.memory and llm.errors only.
"""

from llm.attention.auto import Choice, resolve, resolve_for
from llm.attention.documents import Documents
from llm.attention.registry import (
    BACKENDS,
    AttentionKernel,
    attention,
    check_kernel,
    get_kernel,
    register_backend,
)
from llm.attention.support import Support

__all__ = [
    "BACKENDS",
    "AttentionKernel",
    "Choice",
    "Documents",
    "Support",
    "attention",
    "check_kernel",
    "get_kernel",
    "register_backend",
    "resolve",
    "resolve_for",
]
