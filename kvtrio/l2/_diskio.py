"""The disk backend's blocking file work: run in worker threads only (never on the event loop)."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import attrs

from ._interface import Buffers

__all__ = [
    "Scan",
    "Written",
    "filesystem_space",
    "read_object",
    "reason",
    "scan_tree",
    "unlink_all",
    "write_objects",
]


def read_object(path: str, parts: Buffers) -> bool | None:
    """Read the file into ``parts``; False if its size differs, None if it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size != sum(len(p) for p in parts):
            return False
        pending = [memoryview(p).cast("B") for p in parts if len(p)]
        while pending:  # one readv for all parts; loop only on a short read
            count = os.readv(fd, pending)
            if count == 0:
                return False
            while pending and count >= len(pending[0]):
                count -= len(pending[0])
                pending.pop(0)
            if pending and count:
                pending[0] = pending[0][count:]
        return True
    finally:
        os.close(fd)


def _write_object(tmp_dir: Path, path: str, parts: Buffers, fsync: bool) -> None:
    """Write ``parts`` to a temporary file and rename it to ``path`` (atomic). The bucket
    directory is made by the scan; only if it has vanished since is it made again here.

    If anything fails (writing, creating the bucket, renaming), the temporary file is removed.
    """
    temp = f"{tmp_dir}/{uuid.uuid4().hex}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            pending = [memoryview(p).cast("B") for p in parts if len(p)]
            while pending:
                written = os.writev(fd, pending)
                while pending and written >= len(pending[0]):
                    written -= len(pending[0])
                    pending.pop(0)
                if pending and written:
                    pending[0] = pending[0][written:]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(temp, path)
        except FileNotFoundError:  # the bucket is gone (the scan makes all 256): make it again
            with contextlib.suppress(FileExistsError):
                os.mkdir(os.path.dirname(path))
            os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


@attrs.frozen
class Written:
    written: int
    """How many objects (a prefix of the batch) were written."""
    error: OSError | None
    """The error that stopped the batch (None if all were written)."""
    space: tuple[int, int] | None
    """The filesystem's free and total bytes afterwards (None if unknown)."""


def write_objects(tmp_dir: Path, objects: list[tuple[str, Buffers]], fsync: bool) -> Written:
    """Write the objects in order with :func:`_write_object`; stop at the first that fails;
    then measure the filesystem's free space (one ``statvfs``)."""
    written, error = len(objects), None
    for count, (path, parts) in enumerate(objects):
        try:
            _write_object(tmp_dir, path, parts, fsync)
        except OSError as exc:
            written, error = count, exc
            break
    try:
        space = os.statvfs(tmp_dir)
    except OSError:
        return Written(written, error, None)
    return Written(
        written, error, (space.f_bavail * space.f_frsize, space.f_blocks * space.f_frsize)
    )


def unlink_all(paths: list[str]) -> tuple[int, OSError] | None:
    """Remove the files (missing ones are fine); return how many failed and the first error."""
    failed, first = 0, None
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            failed += 1
            first = first or exc
    return None if first is None else (failed, first)


@attrs.frozen
class Scan:
    objects: list[tuple[bytes, int]]
    """(key, size), oldest first."""
    foreign: list[str]
    free: int
    total: int


def scan_tree(objects_dir: Path, tmp_dir: Path) -> Scan:
    """Create the directories (with all 256 buckets), clear ``tmp/``, list the objects (worker
    thread).

    Anything that is not an object file in its bucket (a stray file, a directory where a file
    belongs, a name that is not a key) is left alone and listed as foreign.
    """
    # Cached KV is the server's user's alone: the root (and so everything in it) is 0700.
    objects_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    objects_dir.mkdir(exist_ok=True)
    tmp_dir.mkdir(exist_ok=True)
    for bucket_number in range(256):  # every bucket now, so a write is create + rename only
        (objects_dir / f"{bucket_number:02x}").mkdir(exist_ok=True)
    for leftover in tmp_dir.iterdir():  # writes interrupted by a crash
        with contextlib.suppress(OSError):
            leftover.unlink()
    found, foreign = [], []
    for bucket in os.scandir(objects_dir):
        if not (bucket.is_dir(follow_symlinks=False) and _is_hex(bucket.name, 2)):
            foreign.append(bucket.path)
            continue
        for entry in os.scandir(bucket.path):
            if not (
                _is_hex(entry.name, 64)
                and entry.name.startswith(bucket.name)
                and entry.is_file(follow_symlinks=False)
            ):
                foreign.append(entry.path)
                continue
            with contextlib.suppress(OSError):  # (removed meanwhile)
                stat = entry.stat(follow_symlinks=False)
                found.append((stat.st_mtime, bytes.fromhex(entry.name), stat.st_size))
    found.sort()  # oldest first: the LRU order
    space = os.statvfs(objects_dir)
    return Scan(
        [(key, size) for _, key, size in found],
        foreign,
        space.f_bavail * space.f_frsize,
        space.f_blocks * space.f_frsize,
    )


def _is_hex(name: str, length: int) -> bool:
    return len(name) == length and all(c in "0123456789abcdef" for c in name)


def reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def filesystem_space(path: Path) -> tuple[int, int]:
    """Free (for unprivileged users) and total bytes of the filesystem holding ``path``."""
    space = os.statvfs(path)
    return space.f_bavail * space.f_frsize, space.f_blocks * space.f_frsize
