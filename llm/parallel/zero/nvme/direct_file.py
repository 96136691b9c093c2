"""One file of offloaded state, read and written whole-section at a time with positioned I/O.

The file is opened with O_DIRECT where the file system takes it (ext4, xfs: reads and writes
bypass the page cache, so the states do not quietly sit in RAM again as file pages); the
buffers and offsets are then page-aligned and every length a multiple of ``ALIGN``. Where
O_DIRECT is refused (tmpfs, some network file systems) the file is opened buffered, and
each read or write is followed by ``posix_fadvise(DONTNEED)``, which starts the write-back
and drops the clean pages. ``mode`` says which one is in use.

The file's whole size is reserved up front (``posix_fallocate``), so a disk without room
fails at start; a write that still meets ENOSPC (or an RLIMIT_FSIZE, EFBIG) raises a
DiskFullError naming the folder.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from pathlib import Path

from llm.errors import DiskFullError
from llm.runfiles.disk import MB, free_bytes

ALIGN = 4096  # O_DIRECT's alignment of buffers, offsets and lengths (a page; any block size)
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def no_space_for_states(folder: Path, need: int) -> str:
    return (
        f"no space left on {folder} ({free_bytes(folder) / MB:.0f} MB free, the offloaded "
        f"states need {need / MB:.0f} MB); free space there or point parallelism.nvme_path at "
        "a disk with room, then run the same command to resume"
    )


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous page-aligned memory of ``aligned(nbytes)`` bytes (O_DIRECT's buffers)."""
    return mmap.mmap(-1, aligned(nbytes))


class DirectFile:
    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = Path(path)
        self.nbytes = aligned(nbytes)
        self.read_bytes = 0
        self.written_bytes = 0
        self._count = threading.Lock()  # reads and writes run on a thread pool
        self.fd, self.mode = self._open()
        try:
            os.posix_fallocate(self.fd, 0, max(self.nbytes, ALIGN))
        except OSError as exc:
            self._raise_if_full(exc, self.nbytes)
            raise

    def _open(self) -> tuple[int, str]:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        direct = getattr(os, "O_DIRECT", 0)
        if direct:
            try:
                fd = os.open(self.path, flags | direct, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
            else:
                if self._direct_works(fd):
                    return fd, "O_DIRECT"
                os.close(fd)
                self.path.unlink()
        return os.open(self.path, flags, 0o600), "buffered + fadvise(DONTNEED)"

    @staticmethod
    def _direct_works(fd: int) -> bool:
        """Some file systems open with O_DIRECT and refuse the first aligned write."""
        try:
            os.pwrite(fd, aligned_buffer(ALIGN), 0)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise
        return True

    @property
    def direct(self) -> bool:
        return self.mode == "O_DIRECT"

    def read(self, buffer: memoryview, offset: int) -> None:
        """Fill ``buffer`` (aligned, a multiple of ALIGN long) from ``offset``."""
        done = 0
        while done < len(buffer):
            n = os.preadv(self.fd, [buffer[done:]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"{self.path} ended at byte {offset + done}")
            done += n
        with self._count:
            self.read_bytes += done
        self._drop(offset, done)

    def write(self, buffer: memoryview, offset: int) -> None:
        done = 0
        try:
            while done < len(buffer):
                done += os.pwritev(self.fd, [buffer[done:]], offset + done)
        except OSError as exc:
            self._raise_if_full(exc, len(buffer))
            raise
        with self._count:
            self.written_bytes += done
        self._drop(offset, done)

    def _drop(self, offset: int, nbytes: int) -> None:
        if not self.direct:
            os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    def drop_cached(self) -> None:
        """Drop the page cache a checkpoint's reads and writes through a mapping left
        behind (flushed first, so nothing written is lost)."""
        os.fsync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _raise_if_full(self, exc: OSError, need: int) -> None:
        if exc.errno in _FULL:
            raise DiskFullError(no_space_for_states(self.path.parent, need)) from exc

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
