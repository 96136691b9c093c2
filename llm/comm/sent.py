"""Counting what collectives send, per kind, drained with one call: ``take_sent()``.

Payload convention (llm/parallel/comm_counter.py describes it): the full-size tensor each
collective works on, per rank.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import torch


class SentBytes(Protocol):
    """Anything that counts the bytes it sends: strategies, MoE exchanges, counters."""

    def take_sent(self) -> dict[str, int]:
        """Bytes per collective kind since the last call; the count starts again at zero."""
        ...


class CommCounter:
    """Payload bytes per collective kind since the last ``take_sent()``, added while ``on``."""

    def __init__(self, on: bool = True) -> None:
        self._sent: Counter[str] = Counter()
        self.on = on

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s bytes under ``kind``."""
        self.add_bytes(kind, tensor.numel() * tensor.element_size())

    def add_bytes(self, kind: str, n: int) -> None:
        if self.on:
            self._sent[kind] += n

    def take_sent(self) -> dict[str, int]:
        sent, self._sent = dict(self._sent), Counter()
        return sent

    def all_reduce_hook(self, buffer: torch.Tensor) -> None:
        """FSDP2's hook after HSDP's all-reduce across replicas: counts its buffer."""
        self.add("all_reduce", buffer)
