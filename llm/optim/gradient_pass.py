"""Extra work an optimizer asks of the training loop on chosen steps: a forward and backward
of a loss of its own choosing, whose gradients it consumes instead of stepping on them.

Sophia (llm/optim/sophia.py) is the one user: every k steps it needs the gradient of the
loss on labels sampled from the model's own predictions. The Trainer asks the strategy
``gradient_pass(step)`` (the optimizer's pass when it is due, else None), runs the step's
micro-batches through ``strategy.micro_batch`` / ``strategy.backward`` with ``pass.loss``
instead of the data loss, so gradients are reduced over ranks exactly as the step's are,
then ``strategy.take_gradient_pass(pass, tokens)`` hands the reduced gradients to
``pass.consume``. The Trainer never learns which optimizer it runs.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from llm.data.dataset import IGNORE


class GradientPass(Protocol):
    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) needs the pass before it."""

    def loss(
        self, logits: torch.Tensor, targets: torch.Tensor, input_ids: torch.Tensor, seed: int
    ) -> torch.Tensor:
        """The loss to differentiate, summed over tokens as the data loss is."""

    def consume(self, tokens: torch.Tensor) -> None:
        """Read each param's ``.grad`` (the pass's gradient of the mean loss over the global
        batch of ``tokens`` target tokens) into the optimizer's state."""


def gradient_pass(optimizer) -> GradientPass | None:
    """The optimizer's gradient pass, if it has one."""
    return getattr(optimizer, "gradient_pass", None)


def sampled_labels(
    logits: torch.Tensor, targets: torch.Tensor, input_ids: torch.Tensor, seed: int
) -> torch.Tensor:
    """Labels drawn from softmax(logits) (B, T, V) -> (B, T), one draw per token by the
    Gumbel-max trick; positions whose target is padding stay padding.

    Each row's noise comes from a generator seeded by ``seed`` and the row's own tokens, so a
    row gets the same labels whichever rank or micro-batch holds it: every strategy samples
    what one process would, which is what lets the parity tests compare them.
    """
    weights = torch.arange(1, input_ids.shape[1] + 1, device=input_ids.device)
    keys = ((input_ids.long() * weights).sum(dim=1) % (2**31)).tolist()  # one host read
    noise = torch.empty_like(logits, dtype=torch.float32)
    for row, key in enumerate(keys):
        g = torch.Generator(device=logits.device).manual_seed((seed * 1_000_003 + key) % 2**63)
        noise[row].uniform_(generator=g)
    gumbel = -torch.log(-torch.log(noise.clamp_(min=1e-20)))
    labels = (logits.detach().float() + gumbel).argmax(dim=-1)
    return torch.where(targets == IGNORE, targets, labels)


def sampled_loss(
    logits: torch.Tensor, targets: torch.Tensor, input_ids: torch.Tensor, seed: int
) -> torch.Tensor:
    """Cross-entropy of ``logits`` against labels sampled from them, summed over tokens."""
    labels = sampled_labels(logits, targets, input_ids, seed)
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )
