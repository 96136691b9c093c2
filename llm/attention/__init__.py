"""One attention signature, several backends chosen by name (``attention.backend`` in the config).

Every backend takes q (B, H, T, D) and k, v (B, Hkv, T, D) with H % Hkv == 0 and returns
(B, H, T, D); grouped-query and multi-query attention are handled inside, so models never
repeat K/V themselves. Later backends (the flash_attn package, our Triton kernel) plug in
with :func:`register_backend` without touching the models.
"""

from llm.attention.registry import BACKENDS, attention, get_backend, register_backend

__all__ = ["BACKENDS", "attention", "get_backend", "register_backend"]
