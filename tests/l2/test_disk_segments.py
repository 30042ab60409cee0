"""The disk backend's segment files: what a restart finds, space given back, damage, reads that
race a removal, a filesystem without holes, a full filesystem part-way through a batch."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

import kvtrio.l2._diskio
import kvtrio.l2.disk
from kvtrio.l2._diskio import ALIGN, RECORD_HEADER, record_size, segment_name
from kvtrio.l2.disk import DiskBackend, DiskOptions
from kvtrio.options import ByteSize

SIZE = 20_000
"""Object size: 24 KiB records (six blocks)."""


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _obj(i: int, size: int = SIZE) -> list[bytes]:
    return [bytes([i % 251]) * 100, bytes([(i * 7) % 251]) * (size - 100)]


async def _get(backend: DiskBackend, i: int, size: int = SIZE) -> bytes | None:
    head, body = bytearray(100), bytearray(size - 100)
    (ok,) = await backend.load([_key(i)], [[memoryview(head), memoryview(body)]])
    return bytes(head + body) if ok else None


def _segments(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "segments").iterdir())


def _backend(root: Path, per_segment: int = 3, **options: Any) -> DiskBackend:
    segment = ByteSize(per_segment * record_size(SIZE))
    return DiskBackend(DiskOptions(path=str(root), segment_size=segment, **options))


async def test_a_restart_finds_exactly_the_live_objects(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    assert (
        await backend.store([_key(i) for i in range(10)], [_obj(i) for i in range(10)])
        == [True] * 10
    )
    assert _segments(tmp_path) == [segment_name(n) for n in range(4)]  # 3 + 3 + 3 + 1
    await backend.delete([_key(3), _key(4), _key(5)])  # all of segment 1: its file goes
    await backend.delete([_key(7)])  # in the middle of segment 2: a hole
    assert await backend.store([_key(0)], [_obj(99)]) == [True]  # replaced
    assert _segments(tmp_path) == [segment_name(n) for n in (0, 2, 3)]
    assert backend.statistics()["segments"] == 3

    await backend.aclose()  # (it stops: the directory lock goes, as at kill -9)
    restarted = _backend(tmp_path)
    live = [0, 1, 2, 6, 8, 9]
    for i in live:
        assert await restarted.lookup_and_lock([_key(i)]) == 1, i
        assert await _get(restarted, i) == b"".join(_obj(99 if i == 0 else i))
    for i in (3, 4, 5, 7):
        assert await restarted.lookup_and_lock([_key(i)]) == 0, i
    stats = restarted.statistics()
    assert (stats["objects"], stats["bytes"]) == (6, 6 * record_size(SIZE))
    # New records go to a new segment (a segment's tail may be torn after a crash).
    assert await restarted.store([_key(20)], [_obj(20)]) == [True]
    assert segment_name(4) in _segments(tmp_path)


async def test_removed_objects_give_their_blocks_back_at_once(tmp_path: Path) -> None:
    backend = _backend(tmp_path, per_segment=8)
    keys = [_key(i) for i in range(8)]
    assert await backend.store(keys, [_obj(i) for i in range(8)]) == [True] * 8
    path = tmp_path / "segments" / segment_name(0)
    full = os.stat(path).st_blocks
    await backend.delete(keys[2:6])  # adjacent records: one hole
    assert os.stat(path).st_blocks <= full - 4 * record_size(SIZE) // 512
    with path.open("rb") as segment:
        segment.seek(2 * record_size(SIZE))
        assert segment.read(4 * record_size(SIZE)) == bytes(4 * record_size(SIZE))
    assert await backend.store([_key(8)], [_obj(8)]) == [True]  # segment 0 is full: a new one
    await backend.delete(keys[:2] + keys[6:])
    assert not path.exists()  # its last record went: the file went


async def test_a_torn_tail_is_not_an_object_after_a_restart(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    assert (
        await backend.store([_key(i) for i in range(3)], [_obj(i) for i in range(3)]) == [True] * 3
    )
    path = tmp_path / "segments" / segment_name(0)
    os.truncate(path, 2 * record_size(SIZE) + RECORD_HEADER + SIZE // 2)  # a crash mid-write
    await backend.aclose()  # (it stops: the directory lock goes, as at kill -9)
    restarted = _backend(tmp_path)
    assert await restarted.lookup_and_lock([_key(0), _key(1), _key(2)]) == 2
    assert await _get(restarted, 1) == b"".join(_obj(1))


async def test_a_damaged_record_header_loses_that_record_only(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    assert (
        await backend.store([_key(i) for i in range(3)], [_obj(i) for i in range(3)]) == [True] * 3
    )
    path = tmp_path / "segments" / segment_name(0)
    with path.open("r+b") as segment:
        segment.seek(record_size(SIZE) + 40)  # a bit of the second record's key
        segment.write(b"\xff")
    await backend.aclose()  # (it stops: the directory lock goes, as at kill -9)
    restarted = _backend(tmp_path)
    assert [await restarted.lookup_and_lock([_key(i)]) for i in range(3)] == [1, 0, 1]
    assert await _get(restarted, 2) == b"".join(_obj(2))
    # The running backend itself checks each record's header when it reads it.
    assert await _get(backend, 1) is None


async def test_a_record_being_read_is_given_back_only_after_the_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load of an unlocked object racing its eviction, delete or replacement reads it whole."""
    backend = _backend(tmp_path)
    assert await backend.store([_key(0), _key(1)], [_obj(0), _obj(1)]) == [True, True]
    reading, proceed = threading.Event(), threading.Event()
    real = kvtrio.l2.disk.read_records

    def slow(records: Any, secret: bytes) -> Any:
        reading.set()
        proceed.wait(10)
        return real(records, secret)

    monkeypatch.setattr(kvtrio.l2.disk, "read_records", slow)
    path = tmp_path / "segments" / segment_name(0)
    got: list[bytes | None] = []
    async with trio.open_nursery() as nursery:

        async def load() -> None:
            got.append(await _get(backend, 0))

        nursery.start_soon(load)
        await trio.to_thread.run_sync(reading.wait, 10)
        blocks = os.stat(path).st_blocks
        await backend.delete([_key(0)])  # not locked: gone from the index at once...
        assert await backend.lookup_and_lock([_key(0)]) == 0
        assert os.stat(path).st_blocks == blocks  # ...but its blocks stay while it is read
        proceed.set()
    assert got == [b"".join(_obj(0))]
    assert os.stat(path).st_blocks < blocks  # given back after the read
    assert await _get(backend, 1) == b"".join(_obj(1))


async def test_without_holes_removed_records_are_unmade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(kvtrio.l2._diskio, "_fallocate", unsupported)
    caplog.set_level(logging.WARNING, logger="kvtrio.l2.disk")
    backend = _backend(tmp_path)
    assert (
        await backend.store([_key(i) for i in range(3)], [_obj(i) for i in range(3)]) == [True] * 3
    )
    await backend.delete([_key(0)])
    await backend.delete([_key(1)])
    assert len([r for r in caplog.records if "cannot punch holes" in r.getMessage()]) == 1
    await backend.aclose()  # (it stops: the directory lock goes, as at kill -9)
    restarted = _backend(tmp_path)
    assert [await restarted.lookup_and_lock([_key(i)]) for i in range(3)] == [0, 0, 1]


async def test_a_filesystem_full_part_way_through_a_batch_stores_a_whole_prefix(
    small_filesystem: Path,
) -> None:
    root = small_filesystem / "l2"
    size = 200 * ALIGN - RECORD_HEADER  # 800 KiB records
    backend = DiskBackend(DiskOptions(path=str(root)))
    assert await backend.store([_key(9)], [_obj(9)]) == [True]  # (capacity measured)
    (small_filesystem / "filler").write_bytes(b"f" * (2 << 20))  # another writer, meanwhile
    keys = [_key(i) for i in range(4)]
    results = await backend.store(keys, [_obj(i, size) for i in range(4)])
    stored = results.count(True)
    assert 0 < stored < 4
    assert results == [True] * stored + [False] * (4 - stored)
    assert backend.statistics()["full"] == 1
    # (Full: the capacity went down to 90% of what is stored, so some were evicted since.)
    sizes = {9: SIZE, 0: size, 1: size, 2: size, 3: size}
    kept = [i for i in sizes if await backend.lookup_and_lock([_key(i)])]
    await backend.aclose()  # (it stops: the directory lock goes, as at kill -9)
    restarted = DiskBackend(DiskOptions(path=str(root)))
    found = [i for i in sizes if await restarted.lookup_and_lock([_key(i)])]
    assert found == kept  # the same objects, and the failed part never shows
    assert found
    assert not set(found) & set(range(stored, 4))
    for i in found:
        assert await _get(restarted, i, sizes[i]) == b"".join(_obj(i, sizes[i]))


async def test_a_store_that_evicts_frees_in_one_call_and_adjacent_records_in_one_punch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _backend(
        tmp_path, per_segment=16, capacity=ByteSize(8 * record_size(SIZE)), eviction="lru"
    )
    assert (
        await backend.store([_key(i) for i in range(8)], [_obj(i) for i in range(8)]) == [True] * 8
    )
    calls: list[int] = []
    punches: list[tuple[int, int]] = []
    real_free, real_punch = kvtrio.l2.disk.free_ranges, kvtrio.l2._diskio._fallocate

    def free(ranges: Any, unlinks: Any, secret: bytes) -> Any:
        calls.append(len(ranges))
        return real_free(ranges, unlinks, secret)

    def punch(fd: int, offset: int, length: int) -> None:
        punches.append((offset, length))
        real_punch(fd, offset, length)

    monkeypatch.setattr(kvtrio.l2.disk, "free_ranges", free)
    monkeypatch.setattr(kvtrio.l2._diskio, "_fallocate", punch)
    new = [_key(i) for i in range(8, 12)]
    assert await backend.store(new, [_obj(i) for i in range(8, 12)]) == [True] * 4
    assert backend.statistics()["evictions"] == 4
    assert calls == [4]  # the batch's evictions: one thread call...
    assert punches == [(0, 4 * record_size(SIZE))]  # ...one hole over the four oldest
    assert [await backend.lookup_and_lock([_key(i)]) for i in (3, 4, 11)] == [0, 1, 1]


class _OsWithoutPositionalVectors:
    """``os`` as Python has it on older macOS: no ``pwritev`` / ``preadv``."""

    def __getattr__(self, name: str) -> Any:
        if name in ("pwritev", "preadv"):
            raise AttributeError(name)
        return getattr(os, name)


async def test_without_pwritev_preadv_or_fallocate_it_works_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvtrio.l2._diskio, "os", _OsWithoutPositionalVectors())
    monkeypatch.setattr(kvtrio.l2._diskio, "_libc_fallocate", lambda: None)
    backend = _backend(tmp_path)
    keys = [_key(i) for i in range(5)]
    assert await backend.store(keys, [_obj(i) for i in range(5)]) == [True] * 5
    await backend.delete([_key(1)])  # (no holes: a tombstone over its header)
    for i in (0, 2, 3, 4):
        assert await _get(backend, i) == b"".join(_obj(i))
    await backend.aclose()  # (it stops: the directory lock goes, as at kill -9)
    restarted = _backend(tmp_path)
    assert [await restarted.lookup_and_lock([key]) for key in keys] == [1, 0, 1, 1, 1]
    assert await _get(restarted, 4) == b"".join(_obj(4))
