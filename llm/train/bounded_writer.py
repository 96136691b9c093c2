"""A torch.distributed.checkpoint writer whose save holds at most one file's tensors.

torch 2.13's ``FileSystemWriter`` keeps every tensor it writes into a file until that file is
closed (``tensor_dict`` in ``_write_files_from_queue``, which only its safetensors format
reads), and a tensor that is a view into a larger storage, as every ZeRO shard is a view into
its bucket, is written as a clone. With one file per rank, a save therefore held a copy of all
of the rank's shards at once: its fp32 masters and moments, 12Φ/N bytes. This writer starts a
new file whenever the next tensor would take the current one past ``file_bytes``, so a save
holds at most one file's copies. The files are ordinary DCP files: ``FileSystemReader`` reads
them, by any number of ranks.
"""

from __future__ import annotations

import math
import queue
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

SUFFIX = ".distcp"  # torch's DEFAULT_SUFFIX: FileSystemReader does not care, tools do


def item_bytes(item: WriteItem) -> int:
    """The bytes a tensor item writes; a pickled object counts as nothing (it is small)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize


def group_items(items: list[WriteItem], file_bytes: int) -> list[list[WriteItem]]:
    """Consecutive items in files of at most ``file_bytes`` (an item larger alone: its own)."""
    files: list[list[WriteItem]] = [[]]
    size = 0
    for item in items:
        n = item_bytes(item)
        if files[-1] and size + n > file_bytes:
            files.append([])
            size = 0
        files[-1].append(item)
        size += n
    return [f for f in files if f]


class BoundedFileWriter(FileSystemWriter):
    def __init__(self, path: str | Path, file_bytes: int) -> None:
        # One thread: several threads would each hold a file's copies at the same time.
        super().__init__(path, single_file_per_rank=True, thread_count=1)
        self.file_bytes = file_bytes

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        prefix = plan.storage_data.prefix  # this rank's, set by prepare_global_plan
        files: queue.Queue = queue.Queue()
        for i, items in enumerate(group_items(plan.items, self.file_bytes)):
            name = f"{prefix}{i}{SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)
