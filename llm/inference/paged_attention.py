"""Decode attention through a block table: one query token per sequence against the keys and
values of its blocks in the paged pool (llm.inference.kv_cache.PagedKVCache).

Shapes: q (B, H, D); k_pool, v_pool (Hkv, n_blocks, block_size, D); block_table (B, M)
int32, the blocks of each sequence in order (padding past its length is never read);
seq_lens (B,) int32, each sequence's tokens including the new one. Returns (B, H, D).

Kernels:

- ``gather`` copies each sequence's blocks into a padded (B, Hkv, M * block_size, D) tensor,
  then runs SDPA with a length mask (any device: the reference the others are checked
  against).
- ``triton`` (llm.inference.triton_paged): our Triton kernel, one program per (sequence, kv
  head) reading the blocks through the table with an online softmax; CUDA only (CPU tensors
  in Triton's interpreter, for tests).
- ``flex`` (llm.inference.flex_paged): torch's FlexAttention over the pool as one physical
  sequence, with a BlockMask built from the table; CUDA, or CPU (compiled to C++).

``auto`` (:func:`resolve_kernel`) is triton on CUDA and gather elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from llm.errors import ConfigError

KERNELS = ("gather", "triton", "flex")
_TRITON_INSTALL = "pip install -c constraints.txt triton==3.9.0"


def resolve_kernel(name: str, device: torch.device | str) -> str:
    """``generate.kernel`` for ``device``: auto is triton on CUDA (when triton imports) and
    gather elsewhere; a kernel the device cannot run is refused in one line."""
    device = torch.device(device)
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_missing() is None else "gather"
    if name not in KERNELS:
        raise ConfigError(f"generate.kernel={name!r} is unknown; choose auto or one of {KERNELS}")
    if name == "triton":
        if device.type != "cuda":
            raise ConfigError(
                f"generate.kernel=triton needs a CUDA device, not {device}; use "
                "generate.kernel=gather (or auto)"
            )
        if why := _triton_missing():
            raise ConfigError(why)
    if name == "flex" and device.type not in ("cuda", "cpu"):
        raise ConfigError(f"generate.kernel=flex runs on CUDA or CPU, not {device}; use gather")
    return name


def _triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return f"generate.kernel=triton needs the triton package: {_TRITON_INSTALL}"
    return None


# Every SDPA backend but cuDNN: torch 2.11 picks cuDNN on an H100, and it builds a plan per new
# key length, which a decode grows by one every step (measured: 48 ms a call while the length
# grows, against 0.7 ms with cuDNN left out; docs/inference.md).
_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False):
    """F.scaled_dot_product_attention with GQA, and without cuDNN on CUDA."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True
        )
    with sdpa_kernel(_WITHOUT_CUDNN):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True
        )


def gather_decode_attention(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, seq_lens: Tensor
) -> Tensor:
    b, m = block_table.shape
    hkv, _, bs, d = k_pool.shape
    index = block_table.long()
    # (Hkv, B, M, bs, D) -> (B, Hkv, M * bs, D)
    k = k_pool[:, index].permute(1, 0, 2, 3, 4).reshape(b, hkv, m * bs, d)
    v = v_pool[:, index].permute(1, 0, 2, 3, 4).reshape(b, hkv, m * bs, d)
    positions = block_table.new_ones(m * bs).cumsum(0) - 1
    mask = positions[None, :] < seq_lens[:, None]  # (B, M * bs)
    return sdpa(q[:, :, None], k, v, mask[:, None, None, :])[:, :, 0]


def paged_decode_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    kernel: str = "gather",
) -> Tensor:
    if kernel == "gather":
        return gather_decode_attention(q, k_pool, v_pool, block_table, seq_lens)
    if kernel == "triton":
        if why := _triton_missing():
            raise ConfigError(why)
        from llm.inference.triton_paged import triton_paged_decode_attention

        return triton_paged_decode_attention(q, k_pool, v_pool, block_table, seq_lens)
    if kernel == "flex":
        from llm.inference.flex_paged import flex_paged_decode_attention

        return flex_paged_decode_attention(q, k_pool, v_pool, block_table, seq_lens)
    raise ConfigError(f"paged attention kernel {kernel!r} is unknown; choose one of {KERNELS}")
