"""The L1 arena: one shared-memory file that the server and its CPU workers map.

CPU engines allocate their KV cache themselves, in memory the server cannot see, so the copy is
engine-driven: the server hands out byte ranges ("slots") of this arena and the worker copies
between its KV tensors and the slots. The arena is a plain file under ``/dev/shm`` (any local
process of the same user can map it by path), not ``multiprocessing.shared_memory``, whose
resource tracker unlinks segments when an attaching process exits (Python ≤ 3.12).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import uuid

import numpy as np
import numpy.typing as npt

__all__ = ["SharedArena", "default_shm_dir"]


def default_shm_dir() -> str:
    """``/dev/shm`` where it exists (Linux), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedArena:
    """A mapped shared-memory file. Create it in the server, :meth:`attach` it in workers."""

    def __init__(self, path: str, size: int, fd: int, owner: bool) -> None:
        self.path = path
        self.size = size
        self._owner = owner
        try:
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buffer: npt.NDArray[np.uint8] = np.frombuffer(self._mmap, dtype=np.uint8)

    @classmethod
    def create(
        cls, size: int, *, directory: str | None = None, prefix: str = "kvtrio"
    ) -> SharedArena:
        """Create and map a new arena of ``size`` bytes (pages are allocated on first touch).

        Raises ``OSError`` if the file cannot be created or sized.
        """
        path = os.path.join(directory or default_shm_dir(), f"{prefix}-{uuid.uuid4().hex}.l1")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(path, size, fd, owner=True)

    @classmethod
    def attach(cls, path: str, size: int) -> SharedArena:
        """Map an existing arena read-write. Raises ``OSError`` if it is missing or too small."""
        fd = os.open(path, os.O_RDWR)
        actual = os.fstat(fd).st_size
        if actual < size:
            os.close(fd)
            raise OSError(f"{path} is {actual} bytes, expected {size}")
        return cls(path, size, fd, owner=False)

    def view(self, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """The bytes ``[offset, offset + nbytes)`` as a writable uint8 array (no copy)."""
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"slot [{offset}, {offset + nbytes}) is outside the arena of {self.size}"
            )
        return self.buffer[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap; the creator also removes the file. Views still alive keep the memory valid
        until they are dropped (numpy holds the mapping)."""
        self.buffer = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):  # views still alive: the mapping goes with them
            self._mmap.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def __repr__(self) -> str:
        return f"<SharedArena {self.path} {self.size} bytes>"
