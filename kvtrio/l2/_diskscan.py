"""The disk backend's scan at start-up: its segments and their records (worker thread only).

A record counts if its header checks out under the L2's secret (:mod:`._diskio`: no client can
forge one) and its object fits in the file; tombstones (records unmade where holes cannot be
punched) are stepped over; zeros (holes, punched records) are skipped with ``SEEK_DATA``;
anything else is damage (a torn write, a flipped bit), stepped over block by block (records are
aligned) and counted, so the records after it are still found.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import re
from pathlib import Path

import attrs

from ._diskio import ALIGN, RECORD_HEADER, fsync_directory, parse_record_header, record_size

__all__ = ["Scan", "load_secret", "report_scan", "scan_tree"]

log = logging.getLogger("kvtrio.l2.disk")

SECRET_SIZE = 32
"""Bytes of the L2's secret (the key of the record headers' MACs)."""
_SEGMENT = re.compile(r"[0-9a-f]{16}\.seg")

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


def scan_tree(root: Path, segments_dir: Path) -> Scan:
    """Create the directories and the secret, list the segments and their records (worker
    thread); unlink segments that hold no record. Anything in ``segments/`` that is not a
    segment file is left alone and listed as foreign."""
    # Cached KV is the server's user's alone: the root (and so everything in it) is 0700.
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    segments_dir.mkdir(exist_ok=True)
    secret, new_secret = load_secret(root)
    found, foreign = [], []
    for entry in os.scandir(segments_dir):
        if _SEGMENT.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            found.append((int(entry.name[:16], 16), entry.path))
        else:
            foreign.append(entry.path)
    segments = []
    damaged = damaged_bytes = 0
    for seq, path in sorted(found):
        with contextlib.suppress(FileNotFoundError):  # (removed meanwhile)
            records, stretches, lost = _scan_segment(path, secret)
            damaged += stretches
            damaged_bytes += lost
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
    )


def load_secret(root: Path) -> tuple[bytes, bool]:
    """The L2's secret from ``root/secret``, made (mode 0600, durable) if there is none; and
    whether it was made now. A file of the wrong size is replaced (every record written with
    the lost secret then fails its check: dropped by the scan, counted and logged)."""
    path = root / "secret"
    try:
        with open(path, "rb") as file:
            secret = file.read(SECRET_SIZE + 1)
        if len(secret) == SECRET_SIZE:
            return secret, False
        os.unlink(path)
    except FileNotFoundError:
        pass
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


def _scan_segment(path: str, secret: bytes) -> tuple[list[ScannedRecord], int, int]:
    """The whole records of a segment, in file order (a header that checks out and an object
    that fits in the file), and the stretches and bytes of damage stepped over."""
    records: list[ScannedRecord] = []
    stretches = lost = 0
    in_damage = False
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        offset = 0
        while offset + RECORD_HEADER <= size:
            raw = os.pread(fd, RECORD_HEADER, offset)
            parsed = parse_record_header(raw, secret)
            if parsed is not None and offset + RECORD_HEADER + parsed[1] <= size:
                key, length, owner = parsed
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
                stretches += not in_damage
                in_damage = True
                lost += min(ALIGN, size - offset)
                offset += ALIGN
    finally:
        os.close(fd)
    return records, stretches, lost


def report_scan(found: Scan, root: Path, counters: collections.Counter[str]) -> None:
    """Log (and count in ``counters``) what the scan found that is not an object."""
    if found.damaged:
        counters["scan_damaged"] = found.damaged
        log.warning(
            "disk L2 %s: skipped %d stretch(es) of damaged or unverifiable records (%d bytes)"
            "%s; the objects in them are lost",
            root,
            found.damaged,
            found.damaged_bytes,
            " (the L2's secret is new: records written without it cannot be trusted)"
            if found.new_secret
            else " (torn writes or damage)",
        )
    if found.foreign:
        counters["foreign_files"] = len(found.foreign)
        log.warning(
            "disk L2 %s: ignoring %d file(s) that are not segments (e.g. %s)",
            root,
            len(found.foreign),
            found.foreign[0],
        )
