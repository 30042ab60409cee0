"""The L1 arena: one shared-memory file that the server and its CPU workers map.

CPU engines allocate their KV cache themselves, in memory the server cannot see, so the copy is
engine-driven: the server hands out byte ranges ("slots") of this arena and the worker copies
between its KV tensors and the slots. The arena is a plain file under ``/dev/shm`` (any local
process of the same user can map it by path), not ``multiprocessing.shared_memory``, whose
resource tracker unlinks segments when an attaching process exits (Python ≤ 3.12).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import mmap
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import cast

import numpy as np
import numpy.typing as npt

__all__ = ["SharedArena", "default_shm_dir", "populate_pages", "reclaim_stale_arenas"]

_SUFFIX = ".l1"
_MADV_POPULATE_WRITE = 23
"""Linux ≥ 5.14: fault in the page tables of a range, as if written (``linux/mman.h``)."""
_POPULATE_SLICE = 16 << 20
"""Bytes populated per call. The kernel holds the process's memory-map lock for the whole of a
call, and a thread that maps or unmaps memory meanwhile (an allocation, a new thread's stack)
waits for it, and every thread that faults a page waits behind that one: one call for 4 GiB
froze the server for seconds (issue 22). A 16 MiB slice takes ~25 ms here."""


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, called through ctypes (which releases the GIL), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - no libc symbols
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return cast("Callable[[int, int, int], int]", function)


def populate_pages(
    buffer: npt.NDArray[np.uint8], stop: threading.Event | None = None, share: float = 1.0
) -> None:
    """Fill the page tables of the shared mapping behind ``buffer`` (Linux; elsewhere nothing),
    without holding the GIL, so that the process's other threads (a client's heartbeats, an
    engine's forward) run meanwhile.

    ``mmap(MAP_POPULATE)`` did the same inside CPython's ``mmap.mmap()``, which holds the GIL:
    attaching a 4 GiB arena stopped every thread of an engine worker for seconds (longer than
    the 10 s heartbeat timeout on a loaded machine). Here ``madvise(MADV_POPULATE_WRITE)``, or
    where the kernel is older, one read per page from numpy (which releases the GIL; tmpfs maps
    the page writable). Blocking: call it from a worker thread; ``stop`` set ends it after the
    current slice (:data:`_POPULATE_SLICE`). ``share`` < 1 paces it: after each slice it sleeps
    so that it takes about that share of one CPU.
    """
    if sys.platform != "linux" or buffer.nbytes == 0:
        return
    madvise = _madvise()
    for start in range(0, buffer.nbytes, _POPULATE_SLICE):
        if stop is not None and stop.is_set():
            return
        piece = buffer[start : start + _POPULATE_SLICE]
        began = time.monotonic()
        if madvise is None or madvise(piece.ctypes.data, piece.nbytes, _MADV_POPULATE_WRITE):
            madvise = None  # (not this kernel: the slow way from here on)
            np.bitwise_or.reduce(piece[:: mmap.PAGESIZE])
        if share < 1.0:
            time.sleep((time.monotonic() - began) * (1.0 / share - 1.0))


def reclaim_stale_arenas(directory: str, prefix: str = "kvtrio") -> list[str]:
    """Remove arena files whose creating server died without removing them (SIGKILL, crash).

    A live server holds an exclusive ``flock`` on its arena; a file nobody holds a lock on is a
    leftover and still pins its memory (tmpfs). Returns the paths removed. Workers still mapping
    a removed file keep their mapping until they unmap it.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(prefix + "-") and name.endswith(_SUFFIX)):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live server owns it
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
        finally:
            os.close(fd)
    return removed


def default_shm_dir() -> str:
    """``/dev/shm`` where it exists (Linux), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedArena:
    """A mapped shared-memory file. Create it in the server, :meth:`attach` it in workers."""

    def __init__(
        self, path: str, size: int, fd: int, creator: bool, populate: bool = False
    ) -> None:
        self.path = path
        self.size = size
        self._creator = creator
        try:
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        # The creator keeps the file open with an exclusive lock for as long as it lives: that
        # is how a later server tells a dead creator's leftover file from a live one.
        self._lock_fd: int | None = fd if creator else None
        if not creator:
            os.close(fd)
        self.buffer: npt.NDArray[np.uint8] = np.frombuffer(self._mmap, dtype=np.uint8)
        if populate:
            populate_pages(self.buffer)

    @classmethod
    def create(
        cls, size: int, *, directory: str | None = None, prefix: str = "kvtrio"
    ) -> SharedArena:
        """Create and map a new arena of ``size`` bytes (pages are allocated on first touch).

        Raises ``OSError`` if the file cannot be created or sized.
        """
        directory = directory or default_shm_dir()
        reclaim_stale_arenas(directory, prefix)
        path = os.path.join(directory, f"{prefix}-{uuid.uuid4().hex}{_SUFFIX}")
        # Created under a name reclaim_stale_arenas() ignores, and renamed once locked: another
        # server starting at the same moment must never see the file unlocked and remove it.
        fresh = path + ".new"
        fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, size)
            os.rename(fresh, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(fresh)
            raise
        return cls(path, size, fd, creator=True)

    @classmethod
    def attach(cls, path: str, size: int, *, populate: bool = True) -> SharedArena:
        """Map an existing arena read-write. Raises ``OSError`` if it is missing or too small.

        With ``populate`` (Linux), the page tables are filled at once (about 0.5 s per GiB here),
        so that copies into the arena later run at memory speed instead of page-faulting
        (first writes ran at 0.85 GB/s, populated ones at 6.2 GB/s); the GIL is released
        meanwhile (:func:`populate_pages`). Blocking: call it from a worker thread.
        """
        fd = os.open(path, os.O_RDWR)
        actual = os.fstat(fd).st_size
        if actual < size:
            os.close(fd)
            raise OSError(f"{path} is {actual} bytes, expected {size}")
        return cls(path, size, fd, creator=False, populate=populate)

    def preallocate(self) -> None:
        """:meth:`allocate`, then :meth:`populate`. Blocking: call it from a worker thread."""
        self.allocate()
        self.populate()

    def allocate(self) -> None:
        """Allocate every page of the file now (tmpfs allocates on first write otherwise), so
        that a full ``/dev/shm`` fails here and not in an engine writing a slot later (SIGBUS).
        About 0.2–0.4 s per GiB here. Blocking; raises ``OSError`` (e.g. ``ENOSPC``)."""
        if not hasattr(os, "posix_fallocate"):  # pragma: no cover - not Linux
            return
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, self.size)
        finally:
            os.close(fd)

    def populate(self, stop: threading.Event | None = None, share: float = 1.0) -> None:
        """Populate this process's mapping of the (allocated) file (:func:`populate_pages`).

        Without it the first write to each page of the server's mapping takes a page fault:
        the server zeroes a store's slots, and zeroing 64 MiB took 49–52 ms the first time
        against 4–5 ms after (``docs/design.md``, issue 17 item 3). Blocking (0.3–1.6 s per GiB
        here, in slices that let the process's other threads map memory meanwhile); ``stop``
        set ends it after the current slice.
        """
        populate_pages(self.buffer, stop, share)

    def view(self, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """The bytes ``[offset, offset + nbytes)`` as a writable uint8 array (no copy)."""
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"slot [{offset}, {offset + nbytes}) is outside the arena of {self.size}"
            )
        return self.buffer[offset : offset + nbytes]

    def memory(self, offset: int, nbytes: int) -> memoryview:
        """The bytes ``[offset, offset + nbytes)`` as a writable memoryview (no copy), for I/O."""
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"slot [{offset}, {offset + nbytes}) is outside the arena of {self.size}"
            )
        return memoryview(self._mmap)[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap; the creator also removes the file. Views still alive keep the memory valid
        until they are dropped (numpy holds the mapping)."""
        self.buffer = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):  # views still alive: the mapping goes with them
            self._mmap.close()
        if self._creator:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __repr__(self) -> str:
        return f"<SharedArena {self.path} {self.size} bytes>"
