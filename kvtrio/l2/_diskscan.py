"""The disk backend's scan at first use: its segments and their records (worker thread only).

A record counts if its header checks out and its object fits in the file; zeros (holes,
punched records) are skipped with ``SEEK_DATA``, damage block by block (records are aligned).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

import attrs

from ._diskio import ALIGN, RECORD_HEADER, parse_record_header, record_size

__all__ = ["Scan", "scan_tree"]

_SEGMENT = re.compile(r"[0-9a-f]{16}\.seg")


@attrs.frozen
class Scan:
    segments: list[tuple[int, list[tuple[bytes, int, int]]]]
    """(sequence number, its records as (key, offset, length) in file order), oldest first."""
    foreign: list[str]
    legacy: int
    """Object files of the earlier one-file-per-object layout (``objects/``), not used."""
    free: int
    total: int


def scan_tree(root: Path, segments_dir: Path) -> Scan:
    """Create the directories, list the segments and their records (worker thread); unlink
    segments that hold no record. Anything in ``segments/`` that is not a segment file is left
    alone and listed as foreign."""
    # Cached KV is the server's user's alone: the root (and so everything in it) is 0700.
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    segments_dir.mkdir(exist_ok=True)
    found, foreign = [], []
    for entry in os.scandir(segments_dir):
        if _SEGMENT.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            found.append((int(entry.name[:16], 16), entry.path))
        else:
            foreign.append(entry.path)
    segments = []
    for seq, path in sorted(found):
        with contextlib.suppress(FileNotFoundError):  # (removed meanwhile)
            records = _scan_segment(path)
            if records:
                segments.append((seq, records))
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
    legacy = 0
    with contextlib.suppress(OSError):
        legacy = sum(len(files) for _, _, files in os.walk(root / "objects"))
    space = os.statvfs(segments_dir)
    return Scan(
        segments, foreign, legacy, space.f_bavail * space.f_frsize, space.f_blocks * space.f_frsize
    )


def _scan_segment(path: str) -> list[tuple[bytes, int, int]]:
    """The whole records of a segment, in file order: a header that checks out and an object
    that fits in the file. Zeros (holes, punched records) are skipped with ``SEEK_DATA``, damage
    block by block."""
    records = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        offset = 0
        while offset + RECORD_HEADER <= size:
            raw = os.pread(fd, RECORD_HEADER, offset)
            parsed = parse_record_header(raw)
            if parsed is not None and offset + RECORD_HEADER + parsed[1] <= size:
                records.append((parsed[0], offset, parsed[1]))
                offset += record_size(parsed[1])
                continue
            if raw.count(0) == len(raw):  # a hole (or zeros): jump to the next data
                try:
                    data = os.lseek(fd, offset, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:
                        break  # no data after it
                    data = offset  # (no SEEK_DATA here: step block by block)
                offset = max(data - data % ALIGN, offset + ALIGN)
            else:
                offset += ALIGN
    finally:
        os.close(fd)
    return records
