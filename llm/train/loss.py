"""The training loss with the LM head fused in (``train.fused_loss``): the summed token
cross-entropy of the final hidden states (N, d) against the head weight (V, d), without the
(N, V) fp32 logits that the plain path (``model(x)``, then ``cross_entropy`` on the upcast
logits) materialises.

- ``chunked``: plain torch, any device. Rows go through the head ``train.fused_loss_chunk``
  at a time (:class:`_ChunkedLinearCrossEntropy`).
- ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (Triton, CUDA).
- ``cce``: Apple's cut-cross-entropy ``linear_cross_entropy`` (Triton, CUDA).

As the plain path does, the matmul runs in the compute dtype (autocast's, else the weight's)
and the softmax and the loss in fp32; padding (``IGNORE``) carries no loss.

The trainer hands :func:`head_loss`'s callable to the model as ``head=``: the model calls it
on its normed hidden states and ``output.weight`` inside its own forward, so every wrapper
that gathers or hooks parameters around the forward (FSDP2's root, our ZeRO-3's root unit,
DDP's reducer; DeepSpeed's ZeRO-3, which gathers a parameter read inside a forward) sees
the head weight used there as before.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import Tensor

from llm.data import IGNORE

# train.fused_loss=NAME -> (the module it imports, its pip name).
PACKAGES = {
    "liger": ("liger_kernel.transformers", "liger-kernel"),
    "cce": ("cut_cross_entropy", "cut-cross-entropy"),
}

# head(hidden (B, T, d), weight (V, d), real): ``real`` is the tokenizer's vocabulary where
# the head is padded past it (model.vocab_multiple), else None.
HeadLoss = Callable[[Tensor, Tensor, int | None], Tensor]


def unavailable(name: str, device: torch.device) -> str | None:
    """Why ``train.fused_loss=name`` cannot run on ``device`` (one line with the fix), or
    None."""
    if name not in PACKAGES:
        return None
    module, pip_name = PACKAGES[name]
    try:
        importlib.import_module(module)
    except ImportError as e:
        return (
            f"train.fused_loss={name} needs the {pip_name} package ({e}); pip install "
            f"{pip_name} on a CUDA machine (requirements-gpu.txt), or use "
            "train.fused_loss=chunked (plain torch) or off"
        )
    if device.type != "cuda":
        return (
            f"train.fused_loss={name} runs Triton kernels, which need a CUDA device "
            f"(train.device={device.type}); use train.fused_loss=chunked (plain torch) or off"
        )
    return None


def compute_dtype(weight: Tensor) -> torch.dtype:
    """The head matmul's dtype: autocast's on the weight's device, else the weight's own (as
    ``nn.Linear`` computes)."""
    device = weight.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _chunks(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk: int,
    grads: tuple[bool, bool],
    real: int | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The summed cross-entropy of ``hidden`` (N, d) @ ``weight`` (V, d).T against
    ``targets`` (N,), ``chunk`` rows at a time; with ``grads`` (for hidden, for weight) also
    its gradients: (N, d) in hidden's dtype and (V, d) accumulated in fp32. Columns from
    ``real`` on (a padded vocabulary) are -inf: no probability, zero gradient."""
    dtype = compute_dtype(weight)
    w = weight.to(dtype)  # (V, d): one copy when autocast changes the dtype
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if grads[0] else None
    grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32) if grads[1] else None
    # Explicit dtypes below: autocast stays on inside a Function's forward.
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, hidden.size(0), chunk):
            rows = slice(start, start + chunk)
            h = hidden[rows].to(dtype)  # (c, d)
            y = targets[rows]  # (c,)
            logits = (h @ w.T).float()  # (c, V) fp32: a fresh tensor, changed in place below
            if real is not None:
                logits[:, real:] = float("-inf")
            valid = y != IGNORE
            picked = y.masked_fill(~valid, 0).unsqueeze(1)  # (c, 1): any index for padding
            lse = torch.logsumexp(logits, dim=1)  # (c,)
            nll = lse - logits.gather(1, picked).squeeze(1)
            loss += torch.where(valid, nll, 0.0).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            # d(sum of nll)/d logits = softmax - one_hot(target), zero on padded rows: (c, V).
            g = logits.sub_(lse.unsqueeze(1)).exp_()
            g.scatter_add_(1, picked, -torch.ones_like(g[:, :1]))
            g = g.mul_(valid.unsqueeze(1)).to(dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = g @ w  # (c, d)
            if grad_weight is not None:
                grad_weight += (g.T @ h).float()  # (V, d)
    return loss, grad_hidden, grad_weight


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The loss is the graph's last op and a scalar, so its gradients are known in the
    forward (Liger's trick): each chunk's (c, V) logits are used for the loss and for both
    gradients at once and freed, and backward only scales the kept gradients by the
    incoming scalar. Kept from forward to backward: the gradients, (N, d) in the hidden
    states' dtype and (V, d) fp32, far below the (N, V) fp32 logits when N and V >> d. Recomputing the logits in backward instead
    would keep nothing extra but run the head's (N, d) x (d, V) matmul a fourth time."""

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, real: int | None
    ) -> Tensor:
        loss, grad_hidden, grad_weight = _chunks(
            hidden, weight, targets, chunk, ctx.needs_input_grad[:2], real
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_linear_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, real: int | None = None
) -> Tensor:
    """Summed token cross-entropy (0-d fp32) of ``hidden`` (..., d) through the head
    ``weight`` (V, d) against ``targets`` (...); never more than ``chunk`` rows of logits;
    ids from ``real`` on (a padded vocabulary) take no probability."""
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    if not torch.is_grad_enabled():  # evaluation: no gradient to compute in the forward
        return _chunks(hidden, weight, targets, chunk, (False, False), real)[0]
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk, real)


def liger_linear_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, real: int | None = None
) -> Tensor:
    """Liger-Kernel's fused linear cross-entropy, summed; the gradient of the weight
    accumulated in fp32 across its chunks (``accum_dtype``). A padded head is handed whole,
    with a bias of the dtype's lowest value on the ids from ``real`` on: their
    probabilities underflow to exactly 0, and the logits' rows keep the padded width, whose
    multiple of 128 the GEMMs need for Hopper's kernels (sliced to 50,257 columns, cuBLAS
    ran sm75 kernels for the head: docs/benchmarks.md)."""
    liger = importlib.import_module(PACKAGES["liger"][0])
    dtype = compute_dtype(weight)
    loss = liger.LigerFusedLinearCrossEntropyLoss(
        ignore_index=IGNORE, reduction="sum", accum_dtype=torch.float32
    )
    bias = None
    if real is not None:
        bias = torch.zeros(weight.size(0), dtype=dtype, device=weight.device)
        bias[real:] = torch.finfo(dtype).min
    # Its kernel multiplies (B*T, d) by (V, d).T as given: both in the compute dtype.
    return loss(weight.to(dtype), hidden.flatten(0, -2).to(dtype), targets.flatten(), bias)


def cce_linear_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, real: int | None = None
) -> Tensor:
    """Apple's cut-cross-entropy, summed. Its default gradient filter (``filter_eps``) stays
    on: it skips softmax entries below the compute dtype's eps / 32, under bf16's error. It
    takes no bias, so a padded head is handed its real rows only (its Triton kernels load
    tiles with masks, not cuBLAS's aligned GEMMs)."""
    cce = importlib.import_module(PACKAGES["cce"][0])
    dtype = compute_dtype(weight)
    return cce.linear_cross_entropy(
        hidden.flatten(0, -2).to(dtype),
        weight[:real].to(dtype),
        targets.flatten(),
        ignore_index=IGNORE,
        reduction="sum",
    )


@torch.compiler.disable
def _fused(
    name: str, hidden: Tensor, weight: Tensor, real: int | None, targets: Tensor, chunk: int
) -> Tensor:
    """Eager under train.compile too (one graph break at the head): the chunk loop would
    unroll into the graph, and the libraries' kernels are Triton already."""
    if name == "chunked":
        return chunked_linear_cross_entropy(hidden, weight, targets, chunk, real)
    if name == "liger":
        return liger_linear_cross_entropy(hidden, weight, targets, real)
    return cce_linear_cross_entropy(hidden, weight, targets, real)


def head_loss(name: str, targets: Tensor, chunk: int) -> HeadLoss:
    """``head(hidden (B, T, d), weight (V, d), real) -> summed loss`` for
    ``train.fused_loss=name`` (not off), which the model calls in place of its output
    projection; ``real``: the vocabulary a padded head covers (None: all of it)."""

    def head(hidden: Tensor, weight: Tensor, real: int | None) -> Tensor:
        return _fused(name, hidden, weight, real, targets, chunk)

    return head
