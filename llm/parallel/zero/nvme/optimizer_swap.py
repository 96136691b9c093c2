"""ZeRO-Infinity's optimizer tier (``parallelism.offload_optimizer=nvme``): each rank's fp32
master and optimizer moments live in files, and the step streams them through a pool of
three host buffers a bucket at a time: while bucket i is stepped, bucket i+1 is read into
the next buffer and bucket i-1 written back from the previous one (a small thread pool:
positioned reads and writes release the GIL).

The optimizer is torch's, unchanged: each bucket's piece tensors and their moments are
pointed at the pool buffer holding the bucket (swap_files.point), the bucket's pieces get
their gradients, and ``optimizer.step()`` steps them (pieces without a gradient are skipped),
so every element sees the arithmetic of the in-memory run, bit for bit. Element-wise
optimizers only (llm/validate/): their state after a zero-lr step with the step count reset
is their fresh state, which is how the moments are made and written at start.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from llm.errors import ConfigError
from llm.optim import materialize_state
from llm.parallel.zero.buffers import BucketBuffers
from llm.parallel.zero.layout import Bucket
from llm.parallel.zero.nvme.direct_file import aligned_buffer
from llm.parallel.zero.nvme.pool import BufferPool
from llm.parallel.zero.nvme.swap_files import SwapFiles, point, sections

SLOTS = 3  # stepping one bucket, reading the next, writing the previous back
MASTER = "master"


class OptimizerSwap:
    def __init__(
        self,
        folder: Path,
        buckets: list[Bucket],
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.rank = rank
        self.device = device
        self.itemsize = dtype.itemsize
        self.files = SwapFiles(folder, sections([b.shard for b in buckets], dtype.itemsize), dtype)
        self.files.add(MASTER)
        self.buffers: list[BucketBuffers] = []
        # Per bucket and kind: (tensor, element offset in the bucket's section).
        self.views: list[dict[str, list[tuple[torch.Tensor, int]]]] = []
        self.kinds: list[str] = []  # the optimizer's moments, once made
        self.pool: BufferPool | None = None
        self._stage = aligned_buffer(max((s.nbytes for s in self.files.sections), default=1))
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="zero-offload")
        self.steps = 0

    # ---- set-up -----------------------------------------------------------------------
    def take(self, buf: BucketBuffers) -> None:
        """Move a just-built bucket's master to its file (made in order of the buckets)."""
        i = len(self.buffers)
        lo = buf.bucket.shard_range(self.rank)[0]
        masters = [(buf.master, 0)] + [
            (t, p.start - lo) for p, t in zip(buf.pieces, buf.piece_tensors, strict=True)
        ]
        self.buffers.append(buf)
        self.views.append({MASTER: masters})
        staged = torch.frombuffer(self._stage, dtype=buf.master.dtype)
        staged[: buf.master.numel()].copy_(buf.master)
        self.files.write(MASTER, i, memoryview(self._stage))
        self._point(i, None)

    def add_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the optimizer's moments bucket by bucket, write them to their files and
        leave every tensor pointing there."""
        group_of = {
            id(t): g for g, group in enumerate(optimizer.param_groups) for t in group["params"]
        }
        for i, buf in enumerate(self.buffers):
            stage = torch.frombuffer(self._stage, dtype=buf.master.dtype).untyped_storage()
            self.files.read(MASTER, i, memoryview(self._stage))
            for tensor, offset in self.views[i][MASTER]:
                point(tensor, stage, offset * self.itemsize)
            materialize_state(optimizer, [(t, group_of[id(t)]) for t in buf.piece_tensors])
            if buf.piece_tensors and self.pool is None:
                self._open_moments(optimizer.state[buf.piece_tensors[0]], buf.piece_tensors[0])
            lo = buf.bucket.shard_range(self.rank)[0]
            for k, kind in enumerate(self.kinds, start=1):
                region = torch.frombuffer(self.pool.view(0, k), dtype=buf.master.dtype)
                views = []
                for p, t in zip(buf.pieces, buf.piece_tensors, strict=True):
                    moment = optimizer.state[t][kind]
                    region[p.start - lo : p.stop - lo].copy_(moment)
                    views.append((moment, p.start - lo))
                self.views[i][kind] = views
                self.files.write(kind, i, self.pool.view(0, k))
            for t in buf.piece_tensors:
                _reset_step(optimizer.state[t])
            self._point(i, None)
        if self.pool is None:  # no pieces on this rank, or an optimizer without moments
            self._open_moments({}, None)
        self._stage = None

    def _open_moments(self, state: dict, piece: torch.Tensor | None) -> None:
        for kind, value in state.items():
            if not (torch.is_tensor(value) and value.dim()):
                continue  # the step count: a scalar, kept in memory
            if value.shape != piece.shape or value.dtype != piece.dtype:
                raise ConfigError(
                    f"parallelism.offload_optimizer=nvme streams element-wise optimizer state, "
                    f"but this optimizer's {kind!r} is {tuple(value.shape)} {value.dtype}; use "
                    "offload_optimizer=cpu"
                )
            self.kinds.append(kind)
            self.files.add(kind)
        stride = max((s.nbytes for s in self.files.sections), default=1)
        self.pool = BufferPool(SLOTS, 1 + len(self.kinds), stride, self.device)

    # ---- the step ---------------------------------------------------------------------
    def step(self, step_bucket: Callable[[BucketBuffers], None]) -> None:
        """Run ``step_bucket(buf)`` on every bucket, each with its master and moments in
        memory, reading ahead and writing back behind it."""
        self.files.drop_cached()
        n, slots = len(self.buffers), len(self.pool)
        reads: dict[int, list[Future]] = {0: self._read(0, 0)} if n else {}
        writes: dict[int, list[Future]] = {}
        try:
            for i, buf in enumerate(self.buffers):
                _wait(reads.pop(i))
                if i + 1 < n:  # the slot it reads into held bucket i + 1 - slots
                    _wait(writes.pop(i + 1 - slots, []))
                    reads[i + 1] = self._read(i + 1, (i + 1) % slots)
                self._point(i, i % slots)
                try:
                    step_bucket(buf)
                finally:
                    self._point(i, None)
                writes[i] = self._write(i, i % slots)
            for i in sorted(writes):
                _wait(writes.pop(i))
        finally:  # a failure: let the I/O in flight end before its buffers are reused
            for pending in (*reads.values(), *writes.values()):
                for f in pending:
                    f.exception()
        self.steps += 1

    def _read(self, i: int, slot: int) -> list[Future]:
        kinds = [MASTER, *self.kinds]
        return [
            self._io.submit(self.files.read, kind, i, self.pool.view(slot, k))
            for k, kind in enumerate(kinds)
        ]

    def _write(self, i: int, slot: int) -> list[Future]:
        kinds = [MASTER, *self.kinds]
        return [
            self._io.submit(self.files.write, kind, i, self.pool.view(slot, k))
            for k, kind in enumerate(kinds)
        ]

    def _point(self, i: int, slot: int | None) -> None:
        """Bucket ``i``'s tensors into pool slot ``slot``, or (None) into the files."""
        for k, kind in enumerate([MASTER, *self.kinds]):
            if slot is None:
                storage, base = self.files.maps[kind], self.files.sections[i].offset
            else:
                storage, base = self.pool.storage(slot), k * self.pool.stride
            for tensor, offset in self.views[i].get(kind, ()):
                point(tensor, storage, base + offset * self.itemsize)

    # ---- what it holds ----------------------------------------------------------------
    def resident(self) -> list[torch.Tensor]:
        """What it keeps in memory: the pool's buffers."""
        return list(self.pool.tensors) if self.pool is not None else []

    def facts(self) -> dict:
        read, written = self.files.bytes_moved()
        return {
            "io": self.files.mode,
            "folder": str(self.files.folder),
            "file_bytes": self.files.nbytes * len(self.files.kinds),
            "pool_bytes": self.pool.nbytes if self.pool is not None else 0,
            "read_bytes": read,
            "written_bytes": written,
            "steps": self.steps,
        }

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self.files.close()


def _wait(futures: list[Future]) -> None:
    for f in futures:
        f.result()


def _reset_step(state: dict) -> None:
    """The zero-lr step that made the state counted itself: a fresh state's count is 0."""
    for key, value in state.items():
        if torch.is_tensor(value) and not value.dim():
            value.zero_()
        elif isinstance(value, int | float) and not isinstance(value, bool):
            state[key] = type(value)(0)
