"""Our FlashAttention-2 kernel in Triton (llm/attention/triton_flash.py), registered here.

The kernel module is imported on first use, so importing llm.attention never imports
Triton; its own TRITON_SUPPORT and triton_available() decide what the config may ask of it.
"""

from __future__ import annotations

import importlib

from torch import Tensor

from llm.attention.documents import Documents
from llm.attention.support import Support, Supports
from llm.errors import ConfigError

MODULE = "llm.attention.triton_flash"


def _kernel_module():
    try:
        return importlib.import_module(MODULE)
    except ModuleNotFoundError as e:
        if e.name != MODULE:
            raise ConfigError(
                f"attention=triton needs the triton package ({e}); pip install triton"
            ) from None
        raise ConfigError(
            f"attention=triton needs {MODULE.replace('.', '/')}.py (our Triton kernel), which "
            "this checkout lacks; use attention=sdpa or flash_attn"
        ) from None


def support() -> Supports:
    """The kernel module's TRITON_SUPPORT (devices, dtypes, head_dims, gqa, dropout,
    document_masking), one Support per device it lists. Its interpreter devices (CPU under
    TRITON_INTERPRET=1) are for correctness tests, not runs, so they are not listed."""
    s = _kernel_module().TRITON_SUPPORT
    one = Support(
        dtypes=tuple(s.dtypes),
        head_dims=tuple(s.head_dims),
        gqa=s.gqa,
        dropout=s.dropout,
        document_mask=s.document_masking,
    )
    return dict.fromkeys(s.devices, one)


def unavailable() -> str | None:
    try:
        return _kernel_module().triton_available()
    except ConfigError as e:
        return str(e)


def triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    dropout_p: float,
    scale: float,
    docs: Documents | None,
) -> Tensor:
    kernel = _kernel_module().flash_attention_triton
    doc_ids = None if docs is None else docs.ids
    return kernel(q, k, v, causal=causal, scale=scale, doc_ids=doc_ids, dropout_p=dropout_p)
