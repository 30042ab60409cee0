"""The disk backend's scan at start-up: its segments and their records (worker thread only).

A record counts if its header checks out under the L2's secret (:mod:`._diskrecord`: no client
can forge one) and its object fits in the file (the names kept with it are not read here: the
backend's ``names`` reads them when the server asks); tombstones (records unmade where holes
cannot be punched) are stepped over; zeros (holes, punched records) are skipped with
``SEEK_DATA``; anything else is damage (a torn write, a flipped bit), stepped over block by
block (records are aligned) and counted, so the records after it are still found. Damage that
starts with a header of the right format carrying another secret's key id
(:func:`~._diskrecord.key_id_of`) is counted apart: the log then says the secret changed, not
that the disk tore.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import re
import stat
from pathlib import Path

import attrs

from ._diskio import fsync_directory
from ._disklock import DirectoryLock, Unusable, not_a_regular_file
from ._diskrecord import ALIGN, RECORD_HEADER, key_id, key_id_of, parse_record_header, record_size
from ._interface import BackendError, BackendMisconfigured

__all__ = ["Scan", "load_secret", "open_tree", "report_scan", "scan_tree"]

log = logging.getLogger("kvtrio.l2.disk")

SECRET_SIZE = 32
"""Bytes of the L2's secret (the key of the record headers' MACs)."""
_SEGMENT = re.compile(r"[0-9a-f]{16}\.seg")
_NEVER_WORKS = frozenset(
    {
        errno.ENOENT,  # a parent that cannot be made (/proc/…)
        errno.ENOTDIR,  # a path under a regular file
        errno.EEXIST,  # the path is a file
        errno.EROFS,
        errno.EACCES,
        errno.EPERM,
        errno.ELOOP,
        errno.ENAMETOOLONG,
    }
)
"""Errors of the first scan that say the local path itself cannot work: no retry mends it."""

ScannedRecord = tuple[bytes, int, int, bytes]
"""(key, offset, length, owner) of a record found by the scan."""


@attrs.frozen
class Scan:
    segments: list[tuple[int, list[ScannedRecord]]]
    """(sequence number, its records in file order), oldest first."""
    foreign: list[str]
    free: int
    total: int
    secret: bytes
    """The key of the record headers' MACs (``<root>/secret``)."""
    new_secret: bool
    """The secret was made by this scan (a first start, or a lost secret file)."""
    damaged: int = 0
    """Stretches of damage stepped over (each is at least one lost record)."""
    damaged_bytes: int = 0
    other_secret: int = 0
    """Of the stretches of damage, those that start with a record signed with another secret
    (the secret file was replaced, or the segments came from another L2)."""


def open_tree(root: Path, segments_dir: Path, lock: DirectoryLock) -> Scan:
    """:func:`scan_tree` with its errors in one line each: :class:`BackendMisconfigured` where
    the directory can never work as it is (a path under a regular file or in ``/proc``,
    read-only, not permitted; another server's; a secret that is not a file), else
    :class:`BackendError` (tried again by the next call)."""
    try:
        return scan_tree(root, segments_dir, lock)
    except Unusable as exc:
        raise BackendMisconfigured(f"disk: {exc}") from None
    except OSError as exc:
        message = f"disk: cannot use {root}: {exc.strerror or type(exc).__name__}"
        if exc.errno not in _NEVER_WORKS:
            raise BackendError(message) from None
        where = f" ({exc.filename})" if exc.filename and exc.filename != str(root) else ""
        raise BackendMisconfigured(
            f"{message}{where}; set path= to a directory this user can create and write"
        ) from None


def scan_tree(root: Path, segments_dir: Path, lock: DirectoryLock) -> Scan:
    """Create the directories, take the directory's ``lock`` (:mod:`._disklock`; kept if the
    scan fails after it), make or read the secret, list the segments and their records (worker
    thread); unlink segments that hold no record. Anything in ``segments/`` that is not a
    segment file is left alone and listed as foreign. Raises :class:`~._disklock.Unusable`
    (the directory is another server's, the secret is not a file) or ``OSError``."""
    # Cached KV is the server's user's alone: the root (and so everything in it) is 0700.
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock.acquire()  # (before anything is read or written: the directory is ours from here)
    segments_dir.mkdir(exist_ok=True)
    secret, new_secret = load_secret(root)
    found, foreign = [], []
    for entry in os.scandir(segments_dir):
        if _SEGMENT.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            found.append((int(entry.name[:16], 16), entry.path))
        else:
            foreign.append(entry.path)
    segments = []
    damaged = damaged_bytes = other_secret = 0
    for seq, path in sorted(found):
        with contextlib.suppress(FileNotFoundError):  # (removed meanwhile)
            records, stretches, lost, others = _scan_segment(path, secret)
            damaged += stretches
            damaged_bytes += lost
            other_secret += others
            if records:
                segments.append((seq, records))
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
    space = os.statvfs(segments_dir)
    return Scan(
        segments,
        foreign,
        space.f_bavail * space.f_frsize,
        space.f_blocks * space.f_frsize,
        secret,
        new_secret,
        damaged,
        damaged_bytes,
        other_secret,
    )


def load_secret(root: Path) -> tuple[bytes, bool]:
    """The L2's secret from ``root/secret``, made (mode 0600, durable) if there is none; and
    whether it was made now. A file of the wrong size is replaced (every record written with
    the lost secret then fails its check: dropped by the scan, counted and logged). A secret
    that is not a regular file (a FIFO: opening it to read would wait for a writer) raises
    :class:`~._disklock.Unusable`; it is opened without waiting."""
    path = root / "secret"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        pass
    else:
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise not_a_regular_file(path, mode)
            secret = os.read(fd, SECRET_SIZE + 1)
        finally:
            os.close(fd)
        if len(secret) == SECRET_SIZE:
            return secret, False
        os.unlink(path)
    secret = os.urandom(SECRET_SIZE)
    temporary = root / f"secret.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secret)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temporary, path)  # (two servers on one path: the first secret wins)
    except FileExistsError:
        os.unlink(temporary)
        return load_secret(root)
    os.unlink(temporary)
    fsync_directory(str(root))
    return secret, True


def _scan_segment(path: str, secret: bytes) -> tuple[list[ScannedRecord], int, int, int]:
    """The whole records of a segment, in file order (a header that checks out and an object
    that fits in the file), the stretches and bytes of damage stepped over, and how many of
    those stretches start with a record signed with another secret."""
    records: list[ScannedRecord] = []
    stretches = lost = others = 0
    ours = key_id(secret)
    in_damage = False
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        offset = 0
        while offset + RECORD_HEADER <= size:
            raw = os.pread(fd, RECORD_HEADER, offset)
            parsed = parse_record_header(raw, secret)
            if parsed is not None and offset + RECORD_HEADER + parsed[1] <= size:
                key, length, owner, _, _ = parsed
                if key:  # (no key: a tombstone, a record unmade without a hole)
                    records.append((key, offset, length, owner))
                offset += record_size(length)
                in_damage = False
                continue
            if raw.count(0) == len(raw):  # a hole (or zeros): jump to the next data
                in_damage = False
                try:
                    data = os.lseek(fd, offset, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:
                        break  # no data after it
                    data = offset  # (no SEEK_DATA here: step block by block)
                offset = max(data - data % ALIGN, offset + ALIGN)
            else:  # damage (or a torn tail): step over it block by block
                if not in_damage:
                    stretches += 1
                    signer = key_id_of(raw)
                    others += signer is not None and signer != ours
                in_damage = True
                lost += min(ALIGN, size - offset)
                offset += ALIGN
    finally:
        os.close(fd)
    return records, stretches, lost, others


def report_scan(found: Scan, root: Path, counters: collections.Counter[str]) -> None:
    """Log (and count in ``counters``) what the scan found that is not an object."""
    if found.damaged:
        counters["scan_damaged"] = found.damaged
        if found.other_secret:
            counters["scan_other_secret"] = found.other_secret
        if found.new_secret:
            why = " (the L2's secret is new: records written without it cannot be trusted)"
        elif found.other_secret == found.damaged:
            why = (
                f" (signed with another secret: {root / 'secret'} was replaced, or the "
                "segments are another L2's; records cannot be trusted without their secret)"
            )
        elif found.other_secret:
            why = (
                f" ({found.other_secret} of them signed with another secret: "
                f"{root / 'secret'} was replaced, or the segments are another L2's; the others "
                "torn writes or damage)"
            )
        else:
            why = " (torn writes or damage)"
        log.warning(
            "disk L2 %s: skipped %d stretch(es) of damaged or unverifiable records (%d bytes)"
            "%s; the objects in them are lost",
            root,
            found.damaged,
            found.damaged_bytes,
            why,
        )
    if found.foreign:
        counters["foreign_files"] = len(found.foreign)
        log.warning(
            "disk L2 %s: ignoring %d file(s) that are not segments (e.g. %s)",
            root,
            len(found.foreign),
            found.foreign[0],
        )
