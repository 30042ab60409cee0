"""Issue 22, item 5 (the backend's part): a read error on one record of the disk L2 fails that
object only, and the backend says which objects it could not read.

EIO is the one fault here that cannot be caused for real: it is injected into the backend's
worker threads for one record of one segment file (``os.preadv`` over that range fails), the
rest is real (files, records, reads).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrio.l2 import BackendError
from kvtrio.l2.disk import DiskBackend, DiskOptions

from .._support.disk_faults import BadRecords, fail_reads_of, segment_of

KEYS = [bytes([i]) * 32 for i in range(4)]


def objects() -> list[list[memoryview]]:
    return [[memoryview(bytes([i]) * 100), memoryview(bytes([i]) * 5000)] for i in range(4)]


def buffers() -> list[list[memoryview]]:
    return [[memoryview(bytearray(100)), memoryview(bytearray(5000))] for _ in range(4)]


async def test_eio_on_one_record_fails_that_object_only_and_names_it(
    tmp_path: Path, bad_records: BadRecords
) -> None:
    """Was: the first OSError failed the whole batch (all four objects, one BackendError)."""
    backend = DiskBackend(DiskOptions(path=str(tmp_path)))
    assert await backend.store(KEYS, objects()) == [True] * 4  # adjacent: one preadv run
    fail_reads_of(backend, bad_records, KEYS[1])
    into = buffers()
    with pytest.raises(BackendError) as raised:
        await backend.load(KEYS, into)
    assert getattr(raised.value, "unreadable", None) == [KEYS[1]]
    assert getattr(raised.value, "results", None) == [True, False, True, True]
    for i in (0, 2, 3):  # the others were read, whole
        assert [bytes(part) for part in into[i]] == [bytes([i]) * 100, bytes([i]) * 5000]
    assert bad_records.failed >= 1
    stats = backend.statistics()
    assert stats["read_errors"] == 1
    assert stats["objects"] == 4  # a read error proves nothing: the object stays (the server
    assert stats["locks"] == 0  # decides, after a second failure)
    # A load of the others alone is not affected at all.
    assert await backend.load([KEYS[0], KEYS[3]], [buffers()[0], buffers()[3]]) == [True, True]
    await backend.aclose()


async def test_a_segment_file_that_cannot_be_opened_fails_the_whole_call(
    tmp_path: Path, bad_records: BadRecords
) -> None:
    """An error that is not one record's (the segment file cannot be opened) stays a plain
    BackendError for the whole call: nothing object-specific to report."""
    backend = DiskBackend(DiskOptions(path=str(tmp_path)))
    assert await backend.store(KEYS[:2], objects()[:2]) == [True, True]
    bad_records.bad_open.append(segment_of(backend, KEYS[0]))
    with pytest.raises(BackendError) as raised:
        await backend.load(KEYS[:2], buffers()[:2])
    assert getattr(raised.value, "unreadable", None) is None
    assert backend.statistics()["errors"] == 1
    await backend.aclose()
