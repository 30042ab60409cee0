"""A disk with bad sectors: the disk L2 backend's ``os`` with reads failing where asked."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from kvtrio.l2._diskio import record_size
from kvtrio.l2.disk import DiskBackend

__all__ = ["BadRecords", "fail_reads_of", "segment_of"]


class BadRecords:
    """``os`` for the disk backend's worker threads, with ``preadv`` failing with EIO wherever
    it would read a byte of one of the given ``(segment path, offset, length)`` records."""

    def __init__(self) -> None:
        self.bad: list[tuple[str, int, int]] = []
        self.bad_open: list[str] = []
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path: str, flags: int, *args: Any) -> int:
        if str(Path(path).resolve()) in self.bad_open:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        return os.open(path, flags, *args)

    def preadv(self, fd: int, buffers: Any, offset: int) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        end = offset + sum(len(memoryview(b).cast("B")) for b in buffers)
        for bad_path, start, length in self.bad:
            if path == bad_path and offset < start + record_size(length) and start < end:
                self.failed += 1
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return os.preadv(fd, buffers, offset)


def segment_of(backend: DiskBackend, key: bytes) -> str:
    """The path of the segment file that holds ``key``'s record."""
    return str(Path(backend._path(backend._index[key][0])).resolve())


def fail_reads_of(backend: DiskBackend, bad: BadRecords, key: bytes) -> None:
    """Make every read of ``key``'s record fail with EIO (a bad sector under it)."""
    _, offset, length = backend._index[key]
    bad.bad.append((segment_of(backend, key), offset, length))
