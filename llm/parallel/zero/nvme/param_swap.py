"""ZeRO-Infinity's parameter tier (``parallelism.offload_params=nvme``, stage 3): each
bucket's 16-bit (working dtype) parameter shard lives in a file. Before a unit (a block, or
the root) is all-gathered its shards are read into a pool buffer, and the unit after it in
the pass's direction is read ahead meanwhile (UnitGatherer says which); once the gather is
done the buffer is free again. After each optimizer step the new shard is written back.

Between uses ``buf.shard`` points into the file's mapping (swap_files.py), as the optimizer
tier's tensors do, so checkpoints save and load it unchanged.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from llm.parallel.zero.buffers import BucketBuffers
from llm.parallel.zero.layout import Bucket
from llm.parallel.zero.nvme.direct_file import aligned_buffer
from llm.parallel.zero.nvme.pool import BufferPool
from llm.parallel.zero.nvme.swap_files import SwapFiles, point, sections

PARAMS = "params"
# Units whose shards are in memory at once: the one gathering, the prefetched next one
# (gathered asynchronously), and the one read ahead of it; one spare.
SLOTS = 4


class ParamSwap:
    def __init__(
        self, folder: Path, buckets: list[Bucket], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.files = SwapFiles(folder, sections([b.shard for b in buckets], dtype.itemsize), dtype)
        self.files.add(PARAMS)
        self.device = device
        self.index = {b.index: i for i, b in enumerate(buckets)}
        self.units: list[list[BucketBuffers]] = []
        self.pool: BufferPool | None = None
        self._stage = aligned_buffer(max((s.nbytes for s in self.files.sections), default=1))
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zero3-params")
        self._slot_of: dict[int, int] = {}  # unit -> pool slot
        self._reading: dict[int, list[Future]] = {}

    def take(self, buf: BucketBuffers) -> None:
        """Move a just-built bucket's shard to its file."""
        self.store(buf, buf.shard)
        self._home(buf)

    def set_units(self, units: list[list[BucketBuffers]]) -> None:
        self.units = units
        widest = max((sum(self._section(b).nbytes for b in u) for u in units), default=1)
        self.pool = BufferPool(SLOTS, 1, widest, self.device)

    def _section(self, buf: BucketBuffers):
        return self.files.sections[self.index[buf.bucket.index]]

    def _home(self, buf: BucketBuffers) -> None:
        point(buf.shard, self.files.maps[PARAMS], self._section(buf).offset)

    # ---- the gatherer's side ----------------------------------------------------------
    def load(self, unit: int) -> None:
        """The unit's shards in memory (their read waited for, or done now)."""
        if unit not in self._slot_of:
            self.read_ahead(unit)
        for f in self._reading.pop(unit, []):
            f.result()
        storage, offset = self.pool.storage(self._slot_of[unit]), 0
        for buf in self.units[unit]:
            point(buf.shard, storage, offset)
            offset += self._section(buf).nbytes

    def read_ahead(self, unit: int) -> None:
        """Start reading the unit's shards when a pool buffer is free."""
        if unit in self._slot_of or not 0 <= unit < len(self.units):
            return
        free = set(range(len(self.pool))) - set(self._slot_of.values())
        if not free:
            return
        slot = self._slot_of[unit] = min(free)
        view, offset, reads = self.pool.view(slot, 0), 0, []
        for buf in self.units[unit]:
            index, nbytes = self.index[buf.bucket.index], self._section(buf).nbytes
            into = view[offset : offset + nbytes]
            reads.append(self._io.submit(self.files.read, PARAMS, index, into))
            offset += nbytes
        self._reading[unit] = reads

    def release(self, unit: int) -> None:
        """The unit's gather is complete: its shards go back to the file's mapping."""
        if unit in self._slot_of and unit not in self._reading:
            for buf in self.units[unit]:
                self._home(buf)
            del self._slot_of[unit]

    # ---- the step's side --------------------------------------------------------------
    def settle(self) -> None:
        """Before the step writes new shards: no read is in flight and no unit is held."""
        self.files.drop_cached()
        for unit in list(self._slot_of):
            for f in self._reading.pop(unit, []):
                f.result()
            self.release(unit)

    def store(self, buf: BucketBuffers, values: torch.Tensor) -> None:
        """Write ``values`` (the new shard, any dtype) as the bucket's shard."""
        staged = torch.frombuffer(self._stage, dtype=self.files.dtype)
        staged[: values.numel()].copy_(values)
        self.files.write(PARAMS, self.index[buf.bucket.index], memoryview(self._stage))

    def resident(self) -> list[torch.Tensor]:
        return (list(self.pool.tensors) if self.pool else []) + [
            torch.frombuffer(self._stage, dtype=torch.uint8)
        ]

    def facts(self) -> dict:
        read, written = self.files.bytes_moved()
        return {
            "io": self.files.mode,
            "file_bytes": self.files.nbytes,
            "pool_bytes": (self.pool.nbytes if self.pool else 0) + len(self._stage),
            "read_bytes": read,
            "written_bytes": written,
        }

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self.files.close()
