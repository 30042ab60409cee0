"""The disk backend's blocking file work: run in worker threads only (never on the event loop).

Objects live in **segment files** (``segments/<16 hex digits>.seg``), appended to in order. A
segment is a sequence of records (:mod:`._diskrecord`: an authenticated header, the object, the
names kept with it, zeros up to the next multiple of :data:`ALIGN`).

A removed record's blocks are given back to the filesystem by punching a hole over it (it then
reads as zeros: no longer a record); a segment whose records are all gone is unlinked. The scan
after a restart (:mod:`._diskscan`) walks each segment's records (skipping holes with
``SEEK_DATA``), so a record counts only if its header is whole and its object fits in the file.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ._diskrecord import (
    ALIGN,
    OWNER_SIZE,
    RECORD_HEADER,
    key_id,
    key_id_of,
    names_digest,
    names_room,
    parse_record_header,
    record_header,
    record_size,
    tombstone,
)
from ._interface import Buffers
from ._segments import Location

__all__ = [
    "ALIGN",
    "OWNER_SIZE",
    "RECORD_HEADER",
    "Freed",
    "Written",
    "filesystem_space",
    "free_ranges",
    "fsync_directory",
    "key_id",
    "key_id_of",
    "names_room",
    "parse_record_header",
    "read_names",
    "read_records",
    "reason",
    "record_header",
    "record_size",
    "segment_name",
    "tombstone",
    "write_records",
]

_IOV_MAX = 1024
_ZEROS = memoryview(bytes(ALIGN))
_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE (linux/falloc.h)


def segment_name(seq: int) -> str:
    return f"{seq:016x}.seg"


# --------------------------------------------------------------------------- writing


@attrs.frozen
class Written:
    written: int
    """How many records (a prefix of the batch) were written whole."""
    error: OSError | None
    """The error that stopped the batch (None if all were written)."""
    space: tuple[int, int] | None
    """The filesystem's free and total bytes afterwards (None if unknown)."""


Record = tuple[str, int, bytes, Buffers]
"""(segment path, offset, key, the object's parts): where a record is read from."""
NewRecord = tuple[str, int, bytes, bytes, Buffers, bytes | None]
"""(segment path, offset, key, owner, the object's parts, its names or None): where a record
goes (names longer than the record's :func:`names_room` are left out)."""


def write_records(records: Sequence[NewRecord], fsync: bool, secret: bytes) -> Written:
    """Write the records (in order; consecutive ones of a segment are contiguous) with one
    ``pwritev`` per run of adjacent records, ``fdatasync`` each file if ``fsync``; stop at the
    first error; then measure the filesystem's free space (one ``statvfs``)."""
    done, error = 0, None
    for path, start, run in _runs(records):
        written, error = _write_run(path, start, run, fsync, secret)
        done += written
        if error is not None:
            break
    directory = os.path.dirname(records[0][0]) if records else "."
    try:
        space = os.statvfs(directory)
    except OSError:
        return Written(done, error, None)
    return Written(done, error, (space.f_bavail * space.f_frsize, space.f_blocks * space.f_frsize))


def _runs(records: Sequence[NewRecord]) -> list[tuple[str, int, list[NewRecord]]]:
    """Split records into runs of adjacent ones of one segment, keeping their order."""
    runs: list[tuple[str, int, list[NewRecord]]] = []
    end = -1
    for record in records:
        path, offset, _, _, parts, _ = record
        if runs and runs[-1][0] == path and offset == end:
            runs[-1][2].append(record)
        else:
            runs.append((path, offset, [record]))
        end = offset + record_size(sum(len(p) for p in parts))
    return runs


def _write_run(
    path: str, start: int, run: list[NewRecord], fsync: bool, secret: bytes
) -> tuple[int, OSError | None]:
    """Write adjacent records; return how many were written whole, and the error if any."""
    iov: list[memoryview] = []
    ends: list[int] = []  # each record's end, relative to start
    position = 0
    for _, _, key, owner, parts, names in run:
        length = sum(len(p) for p in parts)
        size = record_size(length)
        kept = names if names and len(names) <= size - RECORD_HEADER - length else None
        iov.append(memoryview(record_header(key, length, owner, secret, kept)))
        iov += [memoryview(p).cast("B") for p in parts if len(p)]
        padding = size - RECORD_HEADER - length
        if kept:
            iov.append(memoryview(kept))
            padding -= len(kept)
        if padding:
            iov.append(_ZEROS[:padding])
        position += size
        ends.append(position)
    offset = start
    try:
        created = fsync and not os.path.exists(path)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        except FileNotFoundError:  # segments/ is gone (the scan made it): make it again
            with contextlib.suppress(FileExistsError):
                os.mkdir(os.path.dirname(path))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while iov:  # short writes continue
                count = _pwritev(fd, iov[:_IOV_MAX], offset)
                offset += count
                while iov and count >= len(iov[0]):
                    count -= len(iov[0])
                    iov.pop(0)
                if iov and count:
                    iov[0] = iov[0][count:]
            if fsync:
                try:
                    os.fdatasync(fd)
                except OSError:
                    offset = start  # not durable: none of them counts as written
                    raise
        finally:
            os.close(fd)
        if created:
            fsync_directory(os.path.dirname(path))
    except OSError as exc:
        return sum(1 for end in ends if end <= offset - start), exc
    return len(run), None


def fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- reading


def read_records(records: Sequence[Record], secret: bytes) -> list[bool | OSError | None]:
    """Read each record's object into its parts (one ``preadv`` per run of adjacent records of
    a segment). Per record: True, False if it is not there whole under its key (a short file,
    a punched or overwritten record), None if its segment file is gone, the ``OSError`` of its
    read if that failed (a run that fails is read again record by record, so an ``EIO`` under
    one record fails that record only). An ``OSError`` opening a segment file is raised."""
    results: list[bool | OSError | None] = [False] * len(records)
    order = sorted(range(len(records)), key=lambda i: (records[i][0], records[i][1]))
    by_segment: dict[str, list[int]] = {}
    for i in order:
        by_segment.setdefault(records[i][0], []).append(i)
    for path, indices in by_segment.items():
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            for i in indices:
                results[i] = None
            continue
        try:
            for run in _adjacent(records, indices):
                try:
                    _read_run(fd, records, run, results, secret)
                except OSError as exc:
                    if len(run) == 1:
                        results[run[0]] = exc
                        continue
                    for i in run:  # which of them? each alone (the others are read again)
                        try:
                            _read_run(fd, records, [i], results, secret)
                        except OSError as alone:
                            results[i] = alone
        finally:
            os.close(fd)
    return results


def _adjacent(records: Sequence[Record], indices: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    end = -1
    for i in indices:
        _, offset, _, parts = records[i]
        if runs and offset == end and len(runs[-1]) < _IOV_MAX // 4:
            runs[-1].append(i)
        else:
            runs.append([i])
        end = offset + record_size(sum(len(p) for p in parts))
    return runs


def _read_run(
    fd: int,
    records: Sequence[Record],
    run: list[int],
    results: list[bool | OSError | None],
    secret: bytes,
) -> None:
    heads = [bytearray(RECORD_HEADER) for _ in run]
    scratch = memoryview(bytearray(ALIGN))
    iov: list[memoryview] = []
    ends = []
    position = 0
    for head, i in zip(heads, run, strict=True):
        parts = records[i][3]
        length = sum(len(p) for p in parts)
        size = record_size(length)
        iov.append(memoryview(head))
        iov += [memoryview(p).cast("B") for p in parts if len(p)]
        if size - RECORD_HEADER - length:
            iov.append(scratch[: size - RECORD_HEADER - length])
        position += size
        ends.append(position - (size - RECORD_HEADER - length))  # (the padding may be absent)
    offset = start = records[run[0]][1]
    while iov:
        count = _preadv(fd, iov[:_IOV_MAX], offset)
        if count == 0:
            break  # end of file: the records not read whole are False
        offset += count
        while iov and count >= len(iov[0]):
            count -= len(iov[0])
            iov.pop(0)
        if iov and count:
            iov[0] = iov[0][count:]
    for head, i, end in zip(heads, run, ends, strict=True):
        length = sum(len(p) for p in records[i][3])
        parsed = parse_record_header(head, secret)
        whole = parsed is not None and parsed[:2] == (records[i][2], length)
        results[i] = offset - start >= end and whole


def read_names(
    keys: Sequence[bytes],
    index: Mapping[bytes, Location],
    prefix: bytes,
    limit: int,
    path: Callable[[int], str],
    secret: bytes,
) -> list[tuple[bytes, Location, bytes]]:
    """The names kept with the records of ``keys`` that start with ``prefix`` (where ``index``,
    the backend's, still has them), the last key first, at most ``limit`` bytes of names: per
    record its header (checked: MAC, key, length) and its names (checked: the header's digest),
    two reads. A record gone meanwhile (a removed segment, a punched or replaced record) is
    left out. ``index`` is read as the loop changes it (single ``get`` calls only). Raises an
    ``OSError`` other than a missing file."""
    found: list[tuple[bytes, Location, bytes]] = []
    opened, fd = -1, -1  # (one file open at a time: keys come segment by segment)
    try:
        for key in reversed(keys):
            location = index.get(key) if key.startswith(prefix) else None
            if location is None:
                continue
            segment, offset, length = location
            if segment != opened:
                if fd >= 0:
                    os.close(fd)
                opened, fd = segment, -1
                with contextlib.suppress(FileNotFoundError):
                    fd = os.open(path(segment), os.O_RDONLY)
            if fd < 0:
                continue
            parsed = parse_record_header(os.pread(fd, RECORD_HEADER, offset), secret)
            if parsed is None or parsed[:2] != (key, length) or not parsed[3]:
                continue
            if parsed[3] > limit:
                break
            names = os.pread(fd, parsed[3], offset + RECORD_HEADER + length)
            if names_digest(names) == parsed[4]:
                found.append((key, location, names))
                limit -= len(names)
    finally:
        if fd >= 0:
            os.close(fd)
    return found


# --------------------------------------------------------------------------- freeing


@attrs.frozen
class Freed:
    failed: int
    """Ranges or files that could not be freed."""
    error: OSError | None
    unsupported: bool
    """The filesystem cannot punch holes: removed records keep their blocks until their
    segment is unlinked."""


@functools.cache
def _libc_fallocate() -> Any:
    """libc's ``fallocate`` (Linux), or None where there is none (macOS)."""
    function = getattr(ctypes.CDLL(None, use_errno=True), "fallocate", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return function


def _fallocate(fd: int, offset: int, length: int) -> None:
    """Punch a hole (the blocks go back to the filesystem; the range reads as zeros)."""
    function = _libc_fallocate()
    if function is None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
    if function(fd, _PUNCH, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
    """``os.pwritev``, or seek + ``writev`` where Python has no ``pwritev`` (older macOS).
    (Each fd here belongs to one thread's call, so its position is ours to move.)"""
    if hasattr(os, "pwritev"):
        return os.pwritev(fd, buffers, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.writev(fd, buffers)


def _preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, buffers, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.readv(fd, buffers)


def free_ranges(
    punches: Sequence[tuple[str, int, int]], unlinks: Sequence[str], secret: bytes
) -> Freed:
    """Punch holes over ``(segment path, offset, bytes)`` record ranges (adjacent ones at
    once) and unlink segment files. Where the filesystem cannot punch holes, each record's
    header is overwritten with a :func:`tombstone` instead (it is no longer a record; its blocks
    stay until its segment goes). Missing files are fine; other failures are counted, not
    raised."""
    failed, first, unsupported = 0, None, False
    by_segment: dict[str, list[tuple[int, int]]] = {}
    for path, offset, size in sorted(punches):
        by_segment.setdefault(path, []).append((offset, size))
    for path, records in by_segment.items():
        try:
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            continue
        except OSError as exc:
            failed, first = failed + len(records), first or exc
            continue
        try:
            for offset, size in _coalesced(records):
                try:
                    if not unsupported:
                        _fallocate(fd, offset, size)
                        continue
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                        failed, first = failed + 1, first or exc
                        continue
                    unsupported = True
                try:  # no holes here: unmake the records (tombstones)
                    for start, length in records:
                        if offset <= start < offset + size:
                            os.pwrite(fd, tombstone(length, secret), start)
                except OSError as exc:
                    failed, first = failed + 1, first or exc
        finally:
            os.close(fd)
    for path in unlinks:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            failed, first = failed + 1, first or exc
    return Freed(failed, first, unsupported)


def _coalesced(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted (offset, size) ranges with adjacent ones merged."""
    merged: list[tuple[int, int]] = []
    for offset, size in ranges:
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + size)
        else:
            merged.append((offset, size))
    return merged


def reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def filesystem_space(path: Path) -> tuple[int, int]:
    """Free (for unprivileged users) and total bytes of the filesystem holding ``path``."""
    space = os.statvfs(path)
    return space.f_bavail * space.f_frsize, space.f_blocks * space.f_frsize
