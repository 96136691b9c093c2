"""What one attention call saves for backward: bytes autograd holds between forward and
backward, each storage counted once (saved-tensor hooks, llm.memory.ActivationMemoryCounter).

eager keeps O(T^2) per head (fp32 scores, probabilities, the dropout mask when there is
one); flash kernels keep O(T) (q, k, v, the output and the log-sum-exp per row), and
recompute the probabilities in backward. The benchmark and tests/test_attention_memory.py
read it here.
"""

from __future__ import annotations

import torch

from llm.attention.registry import attention
from llm.memory import ActivationMemoryCounter


def saved_bytes(
    backend: str,
    kernel: str = "auto",
    *,
    shape: tuple[int, int, int, int, int],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    causal: bool = True,
) -> int:
    """Bytes one call saves for backward. ``shape``: (B, H, Hkv, T, D)."""
    b, h, h_kv, t, d = shape
    g = torch.Generator(device=device).manual_seed(0)

    def make(heads: int) -> torch.Tensor:
        x = torch.randn(b, heads, t, d, generator=g, device=device, dtype=dtype)
        return x.requires_grad_()

    q, k, v = make(h), make(h_kv), make(h_kv)
    with ActivationMemoryCounter() as counter:
        attention(q, k, v, causal=causal, backend=backend, kernel=kernel)
    return counter.by_label.get("attention", 0)
