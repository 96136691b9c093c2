"""Our FlashAttention-2 in Triton: the entry point, its checks, and what it supports.

Triton is imported lazily, so the repo imports without it; :func:`triton_available` says
whether the compiled kernel can run here. CPU tensors run the same kernels in Triton's
interpreter (numpy, one program at a time) when TRITON_INTERPRET=1 was set before triton
was imported: exact enough for the correctness tests, far too slow to train with, so
``TRITON_SUPPORT.devices`` lists CUDA only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llm.attention.triton_function import FlashAttentionFunction
from llm.errors import ConfigError

_INSTALL = "pip install -c constraints.txt triton==3.9.0"


@dataclass(frozen=True)
class KernelSupport:
    """What :func:`flash_attention_triton` accepts; configs are checked against it up front."""

    devices: tuple[str, ...] = ("cuda",)
    interpreter_devices: tuple[str, ...] = ("cpu",)  # correctness tests only: very slow
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
    head_dims: tuple[int, ...] = (32, 64, 128)
    gqa: bool = True
    dropout: bool = False
    document_masking: bool = True
    min_compute_capability: tuple[int, int] = (8, 0)  # Ampere: bf16 tensor cores


TRITON_SUPPORT = KernelSupport()


def triton_available() -> str | None:
    """None if the compiled kernel can run here, else one line: why not, and the fix."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return f"attention=triton needs the triton package: {_INSTALL}"
    if not torch.cuda.is_available():
        return "attention=triton needs a CUDA GPU (none found); use attention=sdpa"
    capability = torch.cuda.get_device_capability()
    if capability < TRITON_SUPPORT.min_compute_capability:
        need = ".".join(map(str, TRITON_SUPPORT.min_compute_capability))
        return (
            f"attention=triton needs compute capability {need}+ (this GPU has "
            f"{capability[0]}.{capability[1]}); use attention=sdpa"
        )
    return None


def triton_interpreter_problem() -> str | None:
    """None if Triton's interpreter can run our kernels here, else one line: why not, and the
    fix. Triton before 3.7 (3.6 is what torch 2.11 pins) turns a loop bound into an int with
    int() of a 1-element array, which numpy 2.4 refuses; 3.7 squeezes the array first."""
    import numpy as np
    import triton

    try:
        int(np.ones(1))  # what triton < 3.7's interpreter does to every runtime loop bound
        return None
    except TypeError:
        pass
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7):
        return None
    return (
        f"attention=triton in Triton's interpreter (CPU tensors, tests only) needs triton 3.7+ "
        f"with numpy {np.__version__} (triton {triton.__version__}, pinned by torch 2.11, cannot "
        "index with numpy 2.4's arrays); run it on a CUDA GPU, or use torch 2.12+ (triton 3.7+)"
    )


# Under torch.compile the kernel runs as it is, outside the graph (a graph break per call):
# it is fused already, and dynamo's tracing of autotuned user kernels was not tried on a GPU.
@torch.compiler.disable
def flash_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    doc_ids: Tensor | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """softmax(scale * q k^T + mask) v without materialising the (T, T) scores.

    q: (B, H, T, D); k, v: (B, Hkv, T, D) with H % Hkv == 0 (query head h reads K/V head
    h // (H // Hkv)). doc_ids: (B, T) integers; a token attends only inside its own run of
    equal ids (packed documents have non-decreasing ids, so a run is a document), causally
    there when ``causal``. ``scale`` defaults to 1/sqrt(D). Returns (B, H, T, D) in q's dtype.
    """
    _check(q, k, v, doc_ids, dropout_p)
    scale = q.size(-1) ** -0.5 if scale is None else float(scale)
    docs = _document_runs(doc_ids) if doc_ids is not None else ()
    return FlashAttentionFunction.apply(q, k, v, causal, scale, *docs)


def _check(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None, dropout_p: float) -> None:
    if dropout_p > 0.0:
        raise ConfigError(
            f"attention=triton has no dropout (got {dropout_p}); set model.dropout=0 "
            "or use attention=sdpa"
        )
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ConfigError(
            f"triton attention wants q (B, H, T, D) and k, v (B, Hkv, T, D); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    (b, h, t, d), (bk, hk, tk, dk) = q.shape, k.shape
    if (b, t, d) != (bk, tk, dk) or h % hk != 0:
        raise ConfigError(
            f"triton attention: q {tuple(q.shape)} and k/v {tuple(k.shape)} must share B, T and D, "
            "and k/v's head count must divide q's"
        )
    if q.dtype not in TRITON_SUPPORT.dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ConfigError(
            f"triton attention takes one dtype of {[str(x) for x in TRITON_SUPPORT.dtypes]} for "
            f"q, k and v; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if d not in TRITON_SUPPORT.head_dims:
        raise ConfigError(
            f"triton attention supports head dims {TRITON_SUPPORT.head_dims}, not {d}; "
            "change the model's width or head count, or use attention=sdpa"
        )
    if doc_ids is not None and (
        doc_ids.shape != (b, t) or doc_ids.is_floating_point() or doc_ids.device != q.device
    ):
        raise ConfigError(
            f"doc_ids must be integer ids of shape (B, T) = {(b, t)} on {q.device}; got "
            f"{doc_ids.dtype} {tuple(doc_ids.shape)} on {doc_ids.device}"
        )
    try:
        import triton
    except ImportError:
        raise ConfigError(f"attention=triton needs the triton package: {_INSTALL}") from None
    interpreted = (
        triton.knobs.runtime.interpret and q.device.type in TRITON_SUPPORT.interpreter_devices
    )
    if q.device.type not in TRITON_SUPPORT.devices and not interpreted:
        raise ConfigError(
            f"our Triton kernel needs CUDA tensors, not {q.device} (on CPU it runs only in "
            "Triton's interpreter: TRITON_INTERPRET=1 set before triton is imported; tests only)"
        )
    if interpreted and (why := triton_interpreter_problem()):
        raise ConfigError(why)


def _document_runs(doc_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(B, T) ids -> int32 (run index, run start, run end) per token, without a host sync."""
    b, t = doc_ids.shape
    pos = torch.arange(t, device=doc_ids.device).expand(b, t)
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    run = new.cumsum(1) - 1
    start = torch.where(new, pos, 0).cummax(1).values
    end = torch.where(last, pos + 1, t).flip(1).cummin(1).values.flip(1)
    return tuple(x.to(torch.int32).contiguous() for x in (run, start, end))
