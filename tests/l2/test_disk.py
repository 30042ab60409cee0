"""The disk backend beyond the conformance suite: partial batches, foreign files, eviction cost,
a path it cannot use, a full filesystem, prefix-aware eviction, a vanished directory."""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import kvtrio.l2.disk
from kvtrio.l2 import BackendError, BackendMisconfigured
from kvtrio.l2._diskio import record_size, segment_name
from kvtrio.l2.disk import DiskBackend, DiskOptions
from kvtrio.options import ByteSize
from kvtrio.storage import EVICTION_POLICIES, LRU


async def test_a_batch_store_failing_part_way_keeps_the_written_objects_only(
    tmp_path: Path,
) -> None:
    # One object per segment, so that the batch spans three segment files.
    backend = DiskBackend(DiskOptions(path=str(tmp_path), segment_size=ByteSize(1)))
    first, failing, last = b"\x00" * 32, b"\xff" * 32, b"\x01" * 32
    assert await backend.lookup_and_lock([]) == 0  # (the directories exist now)
    # A real fault: the second segment's file cannot be created (a directory is there).
    (tmp_path / "segments" / segment_name(1)).mkdir()
    parts = [[b"h" * 100, b"p" * 1000]] * 3
    with pytest.raises(BackendError, match="writing an object failed"):
        await backend.store([first, failing, last], parts)
    assert await backend.lookup_and_lock([first]) == 1
    await backend.unlock([first])
    assert await backend.lookup_and_lock([failing]) == 0
    assert await backend.lookup_and_lock([last]) == 0
    buffers = [bytearray(100), bytearray(1000)]
    assert await backend.load([first], [buffers]) == [True]
    assert buffers == [bytearray(b"h" * 100), bytearray(b"p" * 1000)]
    stats = backend.statistics()
    assert (stats["objects"], stats["bytes"], stats["stores"], stats["errors"]) == (
        1,
        record_size(1100),
        1,
        1,
    )
    # Nor is the failed part visible after a restart (a new scan of the files).
    await backend.aclose()  # (it stops: the directory lock goes, as at kill -9)
    restarted = DiskBackend(DiskOptions(path=str(tmp_path)))
    assert await restarted.lookup_and_lock([first, failing]) == 1
    assert await restarted.lookup_and_lock([failing]) == 0
    assert await restarted.lookup_and_lock([last]) == 0

    # Once the fault is gone, the same batch stores everything.
    (tmp_path / "segments" / segment_name(1)).rmdir()
    assert await backend.store([first, failing, last], parts) == [True, True, True]
    assert await backend.lookup_and_lock([first, failing, last]) == 3
    stats = backend.statistics()
    assert (stats["objects"], stats["bytes"]) == (3, 3 * record_size(1100))
    await backend.aclose()


# --------------------------------------------------------------------------- issue 11


def _obj(size: int = 1000) -> list[bytes]:
    return [b"h" * 100, b"p" * (size - 100)]


async def test_a_stray_file_in_the_tree_is_ignored_and_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: "Not a directory" on the scan, and 0 of the stored objects found after a restart."""
    backend = DiskBackend(DiskOptions(path=str(tmp_path)))
    keys = [bytes([i]) * 32 for i in range(1, 6)]
    assert await backend.store(keys, [_obj()] * 5) == [True] * 5
    (tmp_path / "segments" / "README.txt").write_text("notes")
    (tmp_path / "segments" / "not-a-segment.seg").write_text("x")
    (tmp_path / "segments" / "zz").mkdir()
    caplog.set_level(logging.WARNING, logger="kvtrio.l2.disk")
    await backend.aclose()  # (it stops: the directory lock goes, as at kill -9)
    restarted = DiskBackend(DiskOptions(path=str(tmp_path)))
    assert await restarted.lookup_and_lock(keys) == 5
    await restarted.unlock(keys)
    assert await restarted.lookup_and_lock(keys) == 5  # (reported once, not per call)
    assert restarted.statistics()["foreign_files"] == 3
    assert len([r for r in caplog.records if "not segments" in r.getMessage()]) == 1
    assert (tmp_path / "segments" / "README.txt").read_text() == "notes"  # left alone


async def test_an_l2_path_that_cannot_be_created_is_a_one_line_backend_error(
    tmp_path: Path,
) -> None:
    """A path that can never work is misconfigured (the start-up probe stops the start)."""
    (tmp_path / "file").write_text("x")
    backend = DiskBackend(DiskOptions(path=str(tmp_path / "file" / "l2")))
    with pytest.raises(
        BackendMisconfigured, match=r"^disk: cannot use .*: Not a directory; set path= to"
    ):
        await backend.lookup_and_lock([b"k" * 32])


class _CountingLRU(LRU):
    """LRU that counts the keys it hands out as victims."""

    def __init__(self) -> None:
        super().__init__()
        self.examined = 0

    def victims(self) -> Iterator[bytes]:
        for key in super().victims():
            self.examined += 1
            yield key


async def test_eviction_examines_only_the_objects_it_evicts(tmp_path: Path) -> None:
    """Was: every store copied and walked the whole index (locked objects included)."""
    policy = _CountingLRU()
    backend = DiskBackend(
        DiskOptions(path=str(tmp_path), capacity=ByteSize(2000 * record_size(1000))),
        policies=lambda: policy,
    )
    locked = [i.to_bytes(32, "big") for i in range(1999)]
    for start in range(0, len(locked), 500):
        batch = locked[start : start + 500]
        assert await backend.store(batch, [_obj()] * len(batch)) == [True] * len(batch)
    assert await backend.lookup_and_lock(locked) == len(locked)  # all but one slot locked
    for i in range(50):  # each store must evict the one unlocked object before it
        key = (10**6 + i).to_bytes(32, "big")
        assert await backend.store([key], [_obj()]) == [True]
    stats = backend.statistics()
    assert stats["evictions"] == 49
    assert policy.examined == 49
    await backend.unlock(locked)
    assert stats["objects"] == 2000


async def test_a_full_filesystem_lowers_the_capacity_and_evicts(small_filesystem: Path) -> None:
    """Was: with the default 32 GiB capacity on a small filesystem, it stayed full for good."""
    backend = DiskBackend(DiskOptions(path=str(small_filesystem / "l2")))
    assert await backend.lookup_and_lock([]) == 0
    assert backend.statistics()["capacity_bytes"] < 4 << 20  # measured at start-up
    filler = small_filesystem / "filler"  # another writer takes most of the space meanwhile
    stored = 0
    for i in range(40):  # 40 × 200 kB: more than the filesystem holds
        key = i.to_bytes(32, "big")
        (ok,) = await backend.store([key], [_obj(200_000)])
        stored += ok
        if i == 5:
            filler.write_bytes(b"f" * (2 << 20))
    stats = backend.statistics()
    assert stats["evictions"] > 0
    assert stats["capacity_bytes"] < (4 << 20) - (2 << 20)
    assert stored >= 30  # it kept working: evicted, then stored
    assert await backend.lookup_and_lock([(39).to_bytes(32, "big")]) == 1


# --------------------------------------------------------------------------- eviction= (disk2)


def _chain(name: int, length: int) -> list[bytes]:
    return [(name * 1000 + i).to_bytes(32, "big") for i in range(length)]


async def _fill_with_chains(backend: DiskBackend, chains: list[list[bytes]]) -> None:
    """Store each chain head first, with its parents, as the write-behind does."""
    for chain in chains:
        for i, key in enumerate(chain):
            parent = chain[i - 1] if i else None
            assert await backend.store([key], [_obj()], parents=[parent]) == [True]


async def _reachable(backend: DiskBackend, chains: list[list[bytes]]) -> int:
    """Objects a prefix lookup can reach (each chain's stored prefix)."""
    total = 0
    for chain in chains:
        found = await backend.lookup_and_lock(chain)
        await backend.unlock(chain[:found])
        total += found
    return total


@pytest.mark.parametrize("eviction", sorted(set(EVICTION_POLICIES) - {"lru"}))
async def test_a_full_disk_keeps_only_reachable_chains(tmp_path: Path, eviction: str) -> None:
    """Was: the disk evicted LRU, heads first, leaving the tails of a prompt unreachable
    (and taking up the room); now a prompt leaves tail first (its parent comes with the store)."""
    backend = DiskBackend(
        DiskOptions(
            path=str(tmp_path), capacity=ByteSize(10 * record_size(1000)), eviction=eviction
        )
    )
    chains = [_chain(n, 4) for n in range(3)]
    await _fill_with_chains(backend, chains)
    stats = backend.statistics()
    assert (stats["objects"], stats["evictions"]) == (10, 2)
    assert await _reachable(backend, chains) == 10  # every object on disk can still hit
    await backend.aclose()


async def test_lru_eviction_is_kept_for_comparison_and_strands_tails(tmp_path: Path) -> None:
    backend = DiskBackend(
        DiskOptions(path=str(tmp_path), capacity=ByteSize(10 * record_size(1000)), eviction="lru")
    )
    chains = [_chain(n, 4) for n in range(3)]
    await _fill_with_chains(backend, chains)
    assert backend.statistics()["objects"] == 10
    assert await _reachable(backend, chains) == 8  # the first chain's head went first


async def test_an_evicted_object_takes_its_stored_successors_first(tmp_path: Path) -> None:
    """Objects after an evicted one can never hit: they go before anything reachable."""
    backend = DiskBackend(DiskOptions(path=str(tmp_path), capacity=ByteSize(6 * record_size(1000))))
    chain, other = _chain(1, 4), _chain(2, 2)
    await _fill_with_chains(backend, [chain, other])
    await backend.delete([chain[1]])  # (e.g. found corrupt): chain[2:] are unreachable now
    await _fill_with_chains(backend, [_chain(3, 3)])
    assert await _reachable(backend, [chain, other]) == 3  # chain[0] and other stayed
    assert backend.statistics()["evictions"] == 2  # chain[2], chain[3]; nothing reachable


def test_an_unknown_eviction_policy_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown eviction policy .fifo.*lru"):
        DiskBackend(DiskOptions(path=str(tmp_path), eviction="fifo"))


async def test_a_vanished_segments_directory_is_made_again(tmp_path: Path) -> None:
    backend = DiskBackend(DiskOptions(path=str(tmp_path)))
    gone, key = b"\xaa" * 32, b"\xab" * 32
    assert await backend.store([gone], [_obj()]) == [True]
    shutil.rmtree(tmp_path / "segments")
    assert await backend.store([key], [_obj()]) == [True]
    assert await backend.lookup_and_lock([key]) == 1
    await backend.unlock([key])
    buffers = [bytearray(100), bytearray(900)]
    assert await backend.load([gone, key], [buffers, buffers]) == [False, True]  # (gone: lost)


async def test_a_small_filesystem_is_said_once_not_at_every_batch(
    small_filesystem: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: an INFO line on almost every written batch (111 for 952 stores)."""
    caplog.set_level(logging.INFO, logger="kvtrio.l2.disk")
    backend = DiskBackend(DiskOptions(path=str(small_filesystem / "l2")))
    for i in range(40):
        await backend.store([i.to_bytes(32, "big")], [_obj(20_000)])
    said = [r for r in caplog.records if "less than capacity" in r.getMessage()]
    assert len(said) == 1


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A real ramfs (reports no size: statvfs gives 0 blocks). Needs root: mount."""
    mount = tmp_path / "ram"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "ramfs", "ramfs", str(mount)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


async def test_a_filesystem_without_a_size_is_bounded_by_capacity_alone(
    ramfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: on ramfs (statvfs 0) the capacity became 0 and nothing was ever stored."""
    caplog.set_level(logging.INFO, logger="kvtrio.l2.disk")
    capacity = 5 * record_size(1100)
    backend = DiskBackend(DiskOptions(path=str(ramfs / "l2"), capacity=ByteSize(capacity)))
    keys = [i.to_bytes(32, "big") for i in range(8)]
    for key in keys:
        assert await backend.store([key], [_obj()]) == [True]
    stats = backend.statistics()
    assert (stats["objects"], stats["capacity_bytes"], stats["evictions"]) == (5, capacity, 3)
    said = [r for r in caplog.records if "reports no size" in r.getMessage()]
    assert len(said) == 1


async def test_callers_waiting_for_a_scan_that_fails_share_its_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: each caller waiting for the failed scan started one of its own, at once, racing
    for the directory lock (one refused as "in use by another kvtrio server": this one). Now
    they share the one failure, and the next call scans again."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")  # the root cannot be made under a file: a real scan failure
    scans, release = [], threading.Event()
    real_open_tree = kvtrio.l2.disk.open_tree

    def open_tree(*args: Any) -> Any:
        scans.append(args)
        release.wait(10)  # (held until every caller waits)
        return real_open_tree(*args)

    monkeypatch.setattr(kvtrio.l2.disk, "open_tree", open_tree)
    backend = DiskBackend(DiskOptions(path=str(blocker / "l2")))
    failed: list[BackendError] = []

    async def lookup() -> None:
        with pytest.raises(BackendError) as info:
            await backend.lookup_and_lock([b"k" * 32])
        failed.append(info.value)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(lookup)
        await trio.testing.wait_all_tasks_blocked()
        release.set()
    assert len(failed) == 3
    assert len(scans) == 1
    blocker.unlink()
    blocker.mkdir()  # the fault is gone: the next call scans again
    assert await backend.lookup_and_lock([b"k" * 32]) == 0
    assert len(scans) == 2
    await backend.aclose()
