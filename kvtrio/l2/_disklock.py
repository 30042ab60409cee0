"""The disk backend's directory lock: one backend (one server) uses an L2 directory at a time.

Two servers on one directory each build their own index and append to the same segment files
at the offsets their own index says are free: each overwrites the other's records, and after a
restart one keeps a few of its objects (issue 32: 5 of 120 prompts). So the first scan takes
an exclusive ``flock`` on ``<root>/lock`` (a file that stays; only the lock comes and goes) and
the backend holds it for its life: a second backend, in this process or another, finds the
directory in use and is refused (:class:`DirectoryInUse`, naming the holder's pid and host as
it wrote them into the file). The lock is released by :meth:`DirectoryLock.release` (the
backend's ``aclose``) or by the kernel when the holder's process ends, ``kill -9`` included,
so a crashed server's lock never blocks its restart. ``flock`` on NFS is a POSIX lock on the
server (Linux ≥ 2.6.12), so hosts sharing an NFS directory are kept apart too.

Blocking file work: call from worker threads only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
from pathlib import Path

__all__ = ["LOCK_NAME", "DirectoryInUse", "DirectoryLock", "Unusable", "not_a_regular_file"]

LOCK_NAME = "lock"


class Unusable(Exception):
    """The L2 directory cannot be used as it is (the message says why, in one line); no retry
    mends it, only the operator."""


class DirectoryInUse(Unusable):
    """Another backend (another server) holds the directory's lock."""


def not_a_regular_file(path: Path, mode: int) -> Unusable:
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else None
    return Unusable(f"{path} is {kind or 'not a regular file'}; expected a regular file")


class DirectoryLock:
    """The exclusive lock of the L2 directory ``root`` (see the module)."""

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (nothing if held already) and write this process's pid and host into
        the file. Never waits: :class:`DirectoryInUse` if another holds it; :class:`Unusable`
        if the lock file is not a regular file; ``OSError`` if it cannot be made or locked."""
        if self._fd is not None:
            return
        # The lock is held on a read-only descriptor (a file open for writing would keep the
        # filesystem from being remounted read-only); the pid is written through another one
        # (closing it does not drop a flock). O_NONBLOCK: a FIFO must not hang the start.
        flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | flags, 0o600))
        fd = os.open(self.path, os.O_RDONLY | flags)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise not_a_regular_file(self.path, mode)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DirectoryInUse(
                    f"{self.path.parent} is in use by another kvtrio server ({_holder(fd)}); "
                    "give each server a path of its own (two servers on one directory "
                    "overwrite each other's objects)"
                ) from None
            writer = os.open(self.path, os.O_WRONLY | os.O_TRUNC | flags)
            try:
                os.write(writer, f"{os.getpid()} {socket.gethostname()}\n".encode())
            finally:
                os.close(writer)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Let the lock go (closing the file drops it; the file stays). Nothing if not held."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _holder(fd: int) -> str:
    """Who holds the lock, as it wrote itself into the file: ``pid N`` (``on HOST`` where that
    is not this host), or ``pid unknown``."""
    with contextlib.suppress(OSError, ValueError):
        pid, _, host = os.pread(fd, 300, 0).decode().strip().partition(" ")
        if pid.isdigit():
            return f"pid {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")
    return "pid unknown"
