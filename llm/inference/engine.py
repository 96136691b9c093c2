"""Continuous batching (Orca; vLLM's scheduler): requests wait in a queue, join the running
batch as soon as the KV cache has room for their prompt, decode one token per step together
with everyone running, and leave when they end, returning their cache at once.

A step: admit waiting requests in arrival order while the cache takes them (each prompt is
prefilled alone, its first token sampled), then one decode step for every running request.
On a paged cache a request that needs a new block when none is free preempts the latest
admitted request (vLLM's recompute preemption): its blocks are freed and it goes back to the
head of the queue, to be prefilled again with the tokens it has so far. Two rules keep that
rare, as vLLM's scheduler does: a request is admitted only while the cache keeps a reserve
(``cache.can_add``: a paged pool keeps 1% of its blocks, at least one, free for the running
sequences to grow into), and no request is admitted in the step after one was preempted, so
the preempted request is not pushed out again by the next admission.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from llm.inference.forward import decode, prefill
from llm.inference.sampling import Sampler


@dataclass(eq=False)  # a request is itself: `in` compares identities
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    # Tokens generated so far; the request ends at max_new_tokens or at eos_id.
    out: list[int] = field(default_factory=list)
    eos_id: int | None = None
    done: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    def finished(self) -> bool:
        hit_eos = self.eos_id is not None and bool(self.out) and self.out[-1] == self.eos_id
        return hit_eos or len(self.out) >= self.max_new_tokens


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    steps: int = 0
    preemptions: int = 0
    max_running: int = 0
    # Per decode step: (tokens the cache holds, tokens it has set aside for them).
    occupancy: list[tuple[int, int]] = field(default_factory=list)

    def tokens_per_s(self) -> dict[str, float | None]:
        return {
            "prefill": self.prefill_tokens / self.prefill_s if self.prefill_s else None,
            "decode": self.decode_tokens / self.decode_s if self.decode_s else None,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    def __init__(self, model, cache, sampler: Sampler, max_running: int | None = None) -> None:
        self.model, self.cache, self.sampler = model, cache, sampler
        self.device = next(model.parameters()).device
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.stats = EngineStats()
        self._preempted = False  # in the last decode step

    def submit(self, request: Request) -> None:
        self.waiting.append(request)

    def run(self) -> list[Request]:
        """Step until every request submitted has ended; the requests in the order they ended."""
        while self.waiting or self.running:
            self.step()
        return self.finished

    def step(self) -> None:
        if not self._preempted or not self.running:
            self._admit()
        if self.running:
            self._decode()
        self.stats.steps += 1

    def _room_for_one(self) -> bool:
        return self.max_running is None or len(self.running) < self.max_running

    def _admit(self) -> None:
        while self.waiting and self._room_for_one():
            request = self.waiting[0]
            if not self.cache.can_add(len(request.tokens)):
                if not self.running:
                    raise RuntimeError(
                        f"request {request.id} ({len(request.tokens)} tokens) does not fit the "
                        "empty KV cache; raise generate.cache_tokens"
                    )
                return
            self.waiting.popleft()
            self._prefill(request)

    def _prefill(self, request: Request) -> None:
        tokens = torch.tensor([request.tokens], device=self.device)
        self.cache.add(request.id, tokens.size(1))
        start = time.perf_counter()
        logits = prefill(self.model, tokens, self.cache, [request.id])[:, -1]
        request.out.append(int(self.sampler(logits, [request.id])[0]))
        _sync(self.device)
        self.stats.prefill_s += time.perf_counter() - start
        self.stats.prefill_tokens += tokens.size(1)
        self._settle(request)

    def _settle(self, request: Request) -> None:
        """Running, or ended: its cache goes back at once."""
        if request.finished():
            request.done = True
            self.cache.free(request.id)
            self.finished.append(request)
        else:
            self.running.append(request)
            self.stats.max_running = max(self.stats.max_running, len(self.running))

    def _make_room(self) -> None:
        """Room in the cache for one more token of every running request, preempting the
        latest admitted ones while some request cannot get it."""
        self._preempted = False
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted below, in an earlier turn of this loop
            while not self.cache.extend(request.id, 1):
                victim = self.running.pop()
                self.cache.free(victim.id)
                self.waiting.appendleft(victim)
                self.stats.preemptions += 1
                self._preempted = True
                if victim is request:
                    break

    def _decode(self) -> None:
        self._make_room()
        if not self.running:
            return
        seqs = [r.id for r in self.running]
        self.stats.occupancy.append((self.cache.used_tokens(), self.cache.reserved_tokens()))
        tokens = torch.tensor([r.out[-1] for r in self.running], device=self.device)
        start = time.perf_counter()
        logits = decode(self.model, tokens, self.cache, seqs)
        new = self.sampler(logits, seqs).tolist()
        _sync(self.device)
        self.stats.decode_s += time.perf_counter() - start
        self.stats.decode_tokens += len(seqs)
        running, self.running = self.running, []
        for request, token in zip(running, new, strict=True):
            request.out.append(token)
            self._settle(request)
