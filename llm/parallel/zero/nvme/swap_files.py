"""One rank's offloaded tensors of one kind (the fp32 master, each optimizer moment, the
stage-3 parameter shards): a file per kind, every bucket's section at the same aligned
offset in each, and a shared mapping of each file that the tensors point at while their
bucket is not in memory.

A tensor is moved between places without changing identity (``Tensor.set_`` onto another
storage): the optimizer's state keeps its keys, and the pieces their ``.grad`` slots. Between
steps every offloaded tensor points into the file mapping. Nothing reads it during training,
so it takes no memory; checkpoints save from it and load into it (through the page cache,
written back to the file), so state.py's checkpoints work unchanged, and ``drop_cached``
lets those pages go again.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

from llm.parallel.zero.nvme.direct_file import DirectFile, aligned


@dataclass(frozen=True)
class Section:
    """A bucket's slice in every file of a SwapFiles: ``numel`` elements at byte ``offset``."""

    offset: int
    numel: int
    nbytes: int  # aligned


def sections(sizes: list[int], itemsize: int) -> list[Section]:
    out, offset = [], 0
    for n in sizes:
        nbytes = aligned(n * itemsize)
        out.append(Section(offset, n, nbytes))
        offset += nbytes
    return out


class SwapFiles:
    """Files named ``<kind>.bin`` under ``folder``, all of ``sections``' total size."""

    def __init__(self, folder: Path, sects: list[Section], dtype: torch.dtype) -> None:
        self.folder = folder
        self.sections = sects
        self.dtype = dtype
        self.nbytes = sum(s.nbytes for s in sects)
        self.files: dict[str, DirectFile] = {}
        self.maps: dict[str, torch.UntypedStorage] = {}
        self._mapped: list[mmap.mmap] = []
        # A checkpoint read or wrote the mappings since the last step: drop those pages.
        self.touched = False

    def add(self, kind: str) -> None:
        file = DirectFile(self.folder / f"{kind}.bin", self.nbytes)
        self.files[kind] = file
        shared = mmap.mmap(file.fd, file.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._mapped.append(shared)
        self.maps[kind] = torch.frombuffer(shared, dtype=torch.uint8).untyped_storage()

    @property
    def kinds(self) -> list[str]:
        return list(self.files)

    @property
    def mode(self) -> str:
        return next(iter(self.files.values())).mode

    def read(self, kind: str, index: int, into: memoryview) -> None:
        s = self.sections[index]
        self.files[kind].read(into[: s.nbytes], s.offset)

    def write(self, kind: str, index: int, out: memoryview) -> None:
        s = self.sections[index]
        self.files[kind].write(out[: s.nbytes], s.offset)

    def bytes_moved(self) -> tuple[int, int]:
        files = self.files.values()
        return sum(f.read_bytes for f in files), sum(f.written_bytes for f in files)

    def drop_cached(self) -> None:
        """Let go of the pages a checkpoint read or wrote through the mappings."""
        if not self.touched:
            return
        self.touched = False
        for shared in self._mapped:
            shared.flush()
            shared.madvise(mmap.MADV_DONTNEED)
        for file in self.files.values():
            file.drop_cached()

    def close(self) -> None:
        # The mappings stay until the tensors viewing them go (the process's end); the
        # files' space is freed once their folder is removed and the last mapping is gone.
        for file in self.files.values():
            file.close()


def point(tensor: torch.Tensor, storage: torch.UntypedStorage, byte_offset: int) -> None:
    """Make ``tensor`` (1-D, contiguous) view ``storage`` from ``byte_offset`` on."""
    with torch.no_grad():
        tensor.set_(storage, byte_offset // tensor.element_size(), tensor.shape, (1,))
