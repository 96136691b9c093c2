"""A few page-aligned host buffers that offloaded buckets are read into, stepped in and
written back from: one slot holds one bucket's tensor of every kind (master, moments) at a
fixed stride. Pinned (registered with CUDA) when the device is a GPU, so copies between them
and the device run asynchronously."""

from __future__ import annotations

import torch

from llm.parallel.zero.nvme.direct_file import aligned, aligned_buffer


class BufferPool:
    def __init__(self, slots: int, kinds: int, stride: int, device: torch.device) -> None:
        self.stride = aligned(stride)
        self.kinds = kinds
        self._buffers = [aligned_buffer(self.stride * max(1, kinds)) for _ in range(slots)]
        self.tensors = [torch.frombuffer(b, dtype=torch.uint8) for b in self._buffers]
        if device.type == "cuda":
            cudart = torch.cuda.cudart()
            for t in self.tensors:
                cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)

    def __len__(self) -> int:
        return len(self._buffers)

    def storage(self, slot: int) -> torch.UntypedStorage:
        return self.tensors[slot].untyped_storage()

    def view(self, slot: int, kind: int) -> memoryview:
        """The slot's region for the ``kind``-th tensor, as a writable buffer for I/O."""
        start = kind * self.stride
        return memoryview(self._buffers[slot])[start : start + self.stride]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tensors)
