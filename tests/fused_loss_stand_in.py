"""Stand-ins for Liger-Kernel and cut-cross-entropy (Triton packages that run on CUDA only):
modules with the names and signatures our adapters call (liger-kernel 0.8.5's
``LigerFusedLinearCrossEntropyLoss``, cut-cross-entropy 25.1.1's ``linear_cross_entropy``),
which check what the adapter hands them, record each call, and compute the loss with torch's
``cross_entropy`` on the materialised logits. Tests put them in sys.modules."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def _reference(e, c, targets, ignore_index: int, reduction: str, bias=None) -> torch.Tensor:
    logits = e @ c.T if bias is None else e @ c.T + bias
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction=reduction)


def _lowest_from(bias: torch.Tensor) -> int | None:
    """The first id whose bias is the dtype's lowest value (a padded head's), or None."""
    lowest = (bias == torch.finfo(bias.dtype).min).nonzero()
    return None if lowest.numel() == 0 else int(lowest[0])


def liger(calls: list) -> dict[str, types.ModuleType]:
    """``liger_kernel`` and ``liger_kernel.transformers`` with the fused loss module."""

    class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):
        def __init__(
            self, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
            label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False,
            accum_dtype=None, use_token_scaling=False, return_token_accuracy=False,
            return_predicted_tokens=False,
        ):  # fmt: skip
            super().__init__()
            self.ignore_index = ignore_index
            self.reduction = reduction
            self.accum_dtype = accum_dtype

        def forward(self, lin_weight, _input, target, bias=None):
            # Its kernel: _input (BT, H) @ lin_weight (V, H).T (+ bias (V,)), one dtype,
            # target (BT,).
            assert _input.dim() == 2 and lin_weight.dim() == 2
            assert _input.size(1) == lin_weight.size(1) and _input.dtype == lin_weight.dtype
            assert target.shape == (_input.size(0),) and target.dtype == torch.int64
            if bias is not None:
                assert bias.shape == (lin_weight.size(0),) and bias.dtype == _input.dtype
            calls.append(
                {
                    "input": (tuple(_input.shape), _input.dtype),
                    "weight": (tuple(lin_weight.shape), lin_weight.dtype),
                    "ignore_index": self.ignore_index,
                    "reduction": self.reduction,
                    "accum_dtype": self.accum_dtype,
                    "bias_lowest_from": None if bias is None else _lowest_from(bias),
                }
            )
            return _reference(_input, lin_weight, target, self.ignore_index, self.reduction, bias)

    transformers = types.ModuleType("liger_kernel.transformers")
    transformers.LigerFusedLinearCrossEntropyLoss = LigerFusedLinearCrossEntropyLoss
    package = types.ModuleType("liger_kernel")
    package.transformers = transformers
    return {"liger_kernel": package, "liger_kernel.transformers": transformers}


def cce(calls: list) -> dict[str, types.ModuleType]:
    """``cut_cross_entropy`` with ``linear_cross_entropy``."""

    def linear_cross_entropy(
        e, c, targets, ignore_index=-100, softcap=None, reduction="mean", shift=False,
        filter_eps="high", impl="cce",
    ):  # fmt: skip
        assert e.size()[:-1] == targets.size() and e.size(-1) == c.size(1)
        assert e.dtype == c.dtype and targets.dtype == torch.int64
        calls.append(
            {
                "e": (tuple(e.shape), e.dtype),
                "c": (tuple(c.shape), c.dtype),
                "ignore_index": ignore_index,
                "reduction": reduction,
                "shift": shift,
                "softcap": softcap,
            }
        )
        return _reference(e.flatten(0, -2), c, targets.flatten(), ignore_index, reduction)

    module = types.ModuleType("cut_cross_entropy")
    module.linear_cross_entropy = linear_cross_entropy
    return {"cut_cross_entropy": module}
