"""The L2 tier inside a server: write-behind, lookups across L2 (with timeouts), loads, faults.

The server runs in the test's trio loop with backend instances the test holds on to, so it can
slow them down, break them, and "restart" the server over the same L2. Clients speak the
protocol directly (slot contents do not matter here; byte equality is the e2e tests' job).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import kvtrio.l2.disk
from kvtrio.config import ServerConfig
from kvtrio.l2 import BackendUnavailable, Buffers
from kvtrio.l2.disk import DiskBackend, DiskOptions
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    EndSession,
    Lookup,
    LookupBatch,
    LookupBatchReply,
    LookupReply,
    Register,
)
from kvtrio.testing import FaultBackend

from .._support.l2_tier import (
    CHUNK,
    HASHES,
    LAYOUT,
    ParentsBackend,
    cache,
    lookup,
    retrieve,
    running,
    stats,
    store,
    written_to_l2,
)
from .._support.waiting import await_async, await_condition


@pytest.fixture
def config(server_config: ServerConfig) -> ServerConfig:
    return attrs.evolve(server_config, lookup_timeout=0.3, retrieve_timeout=2.0)


@pytest.fixture
def fault() -> FaultBackend:
    return FaultBackend(inner=MemoryBackend())


async def test_a_restarted_server_finds_chunks_in_l2_and_retrieve_waits_for_the_loads(
    config: ServerConfig, fault: FaultBackend
) -> None:
    async with running(config, fault) as (_, worker, scheduler):
        await store(worker, "first", 10)
        await written_to_l2(worker, 10)
    async with running(config, fault) as (_, worker, scheduler):  # L1 is empty now
        fault.configure(latency=0.05)  # loads take a while: the retrieve must wait for them
        assert await lookup(scheduler, "second") == LookupReply(10 * CHUNK, 10)
        assert await retrieve(worker, "second") == {"read": list(range(10))}
        state = await cache(worker)
        assert (state.lookup_l2_chunks, state.loads_pending, state.loads_failed) == (10, 0, 0)
        await scheduler.request(EndSession("second", "m"))
        await await_condition(lambda: fault.statistics()["locks"] == 0, what="L2 unlocked")
        assert (await cache(worker)).l1_pins == 0


async def test_a_slow_backend_makes_the_lookup_answer_with_l1_hits_in_time(
    config: ServerConfig, fault: FaultBackend
) -> None:
    async with running(config, fault) as (_, worker, scheduler):
        await store(worker, "first", 10)
        await written_to_l2(worker, 10)
    async with running(config, fault) as (_, worker, scheduler):
        await store(worker, "again", 3)  # L1 has the first 3 chunks, L2 all 10
        fault.configure(latency=2.0)
        started = trio.current_time()
        assert await lookup(scheduler, "slow") == LookupReply(3 * CHUNK, 3)
        assert trio.current_time() - started < config.lookup_timeout + 0.5
        assert fault.statistics()["locks"] == 0  # the cancelled L2 lookup left nothing locked
        assert (await cache(worker)).lookup_timeouts == 1
        fault.configure(latency=0.0)
        assert await lookup(scheduler, "fast") == LookupReply(10 * CHUNK, 10)


async def test_a_retrieve_reports_exactly_the_chunks_whose_loads_failed(
    config: ServerConfig, fault: FaultBackend
) -> None:
    async with running(config, fault) as (_, worker, scheduler):
        await store(worker, "first", 10)
        await written_to_l2(worker, 10)
    async with running(config, fault) as (_, worker, scheduler):
        await store(worker, "again", 5)  # chunks 0-4 in L1, 5-9 only in L2
        await written_to_l2(worker, 5)  # (write-behind pins them until then)
        fault.configure(drop_rate=1.0)  # every load from L2 fails
        assert await lookup(scheduler, "r") == LookupReply(10 * CHUNK, 10)
        assert await retrieve(worker, "r") == {"read": [0, 1, 2, 3, 4], "failed": [5, 6, 7, 8, 9]}
        assert (await cache(worker)).loads_failed == 5
        await scheduler.request(EndSession("r", "m"))
        state = await cache(worker)
        assert (state.l1_pins, state.l1_writing) == (0, 0)


async def test_a_failing_backend_never_takes_the_server_down_and_is_used_again(
    config: ServerConfig, fault: FaultBackend
) -> None:
    async with running(config, fault) as (_, worker, scheduler):
        fault.configure(error_rate=1.0)  # the service "went down"
        await store(worker, "a", 4)  # stores still work (L1), write-behind fails, counted
        await await_condition(lambda: fault.injected["errors"] >= 1, what="a failed write")
        assert await lookup(scheduler, "b", 4) == LookupReply(4 * CHUNK, 4)
        backend_stats = (await stats(worker)).l2[0]
        assert not backend_stats.healthy
        assert backend_stats.counters["errors"] >= 1
        fault.configure(error_rate=0.0)  # back

        async def healthy() -> bool:
            return (await stats(worker)).l2[0].healthy

        await await_async(healthy, what="the backend to be tried again")
        await store(worker, "c", 6)
        await written_to_l2(worker, 2)  # chunks 4 and 5 reached L2 (0-3 were skipped)


async def test_a_full_write_behind_queue_skips_and_counts(
    config: ServerConfig, fault: FaultBackend
) -> None:
    config = attrs.evolve(config, write_behind_queue=1)
    async with running(config, fault) as (_, worker, _scheduler):
        fault.configure(latency=0.5)
        await store(worker, "a", 10)
        state = await cache(worker)
        assert state.write_behind_skipped >= 5
        fault.configure(latency=0.0)

        async def unpinned() -> bool:  # queued chunks are unpinned once written
            return (await cache(worker)).l1_pins == 0

        await await_async(unpinned, what="the write-behind to drain")


async def test_end_session_cancels_pending_loads(config: ServerConfig, fault: FaultBackend) -> None:
    async with running(config, fault) as (_, worker, scheduler):
        await store(worker, "first", 10)
        await written_to_l2(worker, 10)
    config = attrs.evolve(config, lookup_timeout=5.0)
    async with running(config, fault) as (_, worker, scheduler):
        fault.configure(latency=1.0)
        assert (await lookup(scheduler, "r")).hit_chunks == 10
        assert (await cache(worker)).loads_pending == 10
        await scheduler.request(EndSession("r", "m"))
        state = await cache(worker)
        assert (state.loads_pending, state.l1_writing, state.l1_pins) == (0, 0, 0)
        await await_condition(lambda: fault.statistics()["locks"] == 0, what="L2 unlocked")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
async def test_a_damaged_object_on_disk_is_a_miss_deleted_and_counted(
    config: ServerConfig, tmp_path: Path, damage: str
) -> None:
    disk = DiskBackend(DiskOptions(path=str(tmp_path)))
    async with running(config, disk) as (_, worker, scheduler):
        await store(worker, "first", 1)
        await written_to_l2(worker, 1)
    (path,) = (tmp_path / "segments").glob("*.seg")  # (one record: header, object, padding)
    damaged = bytearray(path.read_bytes())
    if damage == "flip":
        damaged[len(damaged) // 2] ^= 0x01  # a bit of the chunk, at rest
        path.write_bytes(damaged)
    disk = DiskBackend(DiskOptions(path=str(tmp_path)))  # a new server process would scan anew
    async with running(config, disk) as (_, worker, scheduler):
        assert await disk.lookup_and_lock([]) == 0  # (the scan has run: it found the object)
        if damage == "truncate":  # cut short behind the server's back
            path.write_bytes(damaged[: len(damaged) - 5000])
        assert (await lookup(scheduler, "r", 1)).hit_chunks == 1  # found in L2, not yet read
        assert await retrieve(worker, "r", 1) == {"failed": [0]}
        await scheduler.request(EndSession("r", "m"))
        counters = (await stats(worker)).l2[0].counters
        if damage == "flip":
            assert (await cache(worker)).l2_corrupt == 1  # the frame's checksum caught it
        else:
            assert counters["unreadable"] == 1  # the size caught it
        assert not path.exists()
        assert (await lookup(scheduler, "r2", 1)).hit_chunks == 0


class _CountingBackend(MemoryBackend):
    """A real memory backend that counts its store calls (to see the write-behind batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.store_calls = 0

    async def store(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        self.store_calls += 1
        return await super().store(keys, buffers)


async def test_chunks_queued_at_once_are_written_in_batches(config: ServerConfig) -> None:
    counting = _CountingBackend()
    async with running(config, counting) as (_, worker, _scheduler):
        await store(worker, "a", 10)  # ten chunks committed (and queued) in one go
        await written_to_l2(worker, 10)
        state = await cache(worker)
        assert (state.write_behind_skipped, state.write_behind_queued, state.l1_pins) == (0, 0, 0)
        assert counting.statistics()["objects"] == 10
        assert counting.store_calls < 10


async def test_the_write_behind_gives_each_chunk_its_parent_to_a_backend_that_takes_it(
    config: ServerConfig,
) -> None:
    """For the disk's prefix-aware eviction (a backend without ``accepts_parents`` is called
    without them: the other tests here)."""
    backend = ParentsBackend()
    async with running(config, backend) as (_, worker, _scheduler):
        await store(worker, "a", 10)
        await written_to_l2(worker, 10)
    assert len(backend.parents) == 10
    for key, parent in backend.parents.items():
        space, chunk = key[: -len(HASHES[0])], HASHES.index(key[-len(HASHES[0]) :])
        assert parent == (None if chunk == 0 else space + HASHES[chunk - 1])


# --------------------------------------------------------------------------- batched loads


class _RecordingLoads(MemoryBackend):
    """A real memory backend that records its load, unlock and delete calls; loads can be
    told to answer False for some chunks (``refuse``), to raise (``error``), or to block."""

    def __init__(self) -> None:
        super().__init__()
        self.load_calls: list[list[int]] = []
        self.unlocked: collections.Counter[bytes] = collections.Counter()
        self.deleted: list[int] = []
        self.refuse: set[int] = set()
        self.error: Exception | None = None
        self.block = False

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        self.load_calls.append([_chunk_of(key) for key in keys])
        if self.block:
            await trio.sleep_forever()
        if self.error is not None:
            raise self.error
        results = await super().load(keys, buffers)
        return [
            ok and _chunk_of(key) not in self.refuse for key, ok in zip(keys, results, strict=True)
        ]

    async def unlock(self, keys: Sequence[bytes]) -> None:
        self.unlocked.update(keys)
        await super().unlock(keys)

    async def delete(self, keys: Sequence[bytes]) -> None:
        self.deleted += [_chunk_of(key) for key in keys]
        await super().delete(keys)


def _chunk_of(key: bytes) -> int:
    return HASHES.index(key[-len(HASHES[0]) :])


async def _only_in_l2(config: ServerConfig, backend: MemoryBackend) -> None:
    async with running(config, backend) as (_, worker, _scheduler):
        await store(worker, "first", 10)
        await written_to_l2(worker, 10)


async def test_the_l2_hits_of_a_lookup_are_loaded_in_growing_batches(
    config: ServerConfig,
) -> None:
    backend = _RecordingLoads()
    await _only_in_l2(config, backend)
    async with running(config, backend) as (_, worker, scheduler):
        assert await lookup(scheduler, "r") == LookupReply(10 * CHUNK, 10)
        assert await retrieve(worker, "r") == {"read": list(range(10))}
        # 1, 2, 4, … chunks a call (the first comes back alone): not one call per chunk
        assert sorted(backend.load_calls) == [[0], [1, 2], [3, 4, 5, 6], [7, 8, 9]]
        assert sorted(_chunk_of(k) for k in backend.unlocked) == list(range(10))
        assert set(backend.unlocked.values()) == {1}  # each key unlocked exactly once
        assert backend.statistics()["locks"] == 0


async def test_a_batched_load_failing_part_way_fails_exactly_its_chunks(
    config: ServerConfig,
) -> None:
    backend = _RecordingLoads()
    await _only_in_l2(config, backend)
    backend.refuse = {3, 7}  # answered: not there at its size (so of no use: deleted)
    async with running(config, backend) as (_, worker, scheduler):
        assert (await lookup(scheduler, "r")).hit_chunks == 10
        reply = await retrieve(worker, "r")
        assert reply == {"read": [0, 1, 2, 4, 5, 6, 8, 9], "failed": [3, 7]}
        assert sorted(backend.deleted) == [3, 7]
        assert set(backend.unlocked.values()) == {1}
        assert len(backend.unlocked) == 10
        state = await cache(worker)
        assert (state.loads_failed, state.loads_pending) == (2, 0)
        await scheduler.request(EndSession("r", "m"))
        assert (await cache(worker)).l1_pins == 0


async def test_a_batched_load_that_raises_fails_its_chunks_and_deletes_nothing(
    config: ServerConfig,
) -> None:
    backend = _RecordingLoads()
    await _only_in_l2(config, backend)
    backend.error = BackendUnavailable("gone for a moment")
    async with running(config, backend) as (_, worker, scheduler):
        assert (await lookup(scheduler, "r")).hit_chunks == 10
        assert await retrieve(worker, "r") == {"failed": list(range(10))}
        assert backend.deleted == []  # an error proves nothing about the objects
        assert set(backend.unlocked.values()) == {1}
        assert len(backend.unlocked) == 10
        assert backend.statistics()["objects"] == 10
        await scheduler.request(EndSession("r", "m"))
        state = await cache(worker)
        assert (state.loads_failed, state.l1_pins, state.l1_writing) == (10, 0, 0)


async def test_a_cancelled_batch_leaves_nothing_locked_or_reserved(config: ServerConfig) -> None:
    backend = _RecordingLoads()
    await _only_in_l2(config, backend)
    backend.block = True  # the batch hangs in the backend until its request ends
    async with running(config, backend) as (_, worker, scheduler):
        assert (await lookup(scheduler, "r")).hit_chunks == 10
        assert (await cache(worker)).loads_pending == 10
        await scheduler.request(EndSession("r", "m"))
        state = await cache(worker)
        assert (state.loads_pending, state.l1_writing, state.l1_pins) == (0, 0, 0)
        await await_condition(lambda: backend.statistics()["locks"] == 0, what="L2 unlocked")
        assert set(backend.unlocked.values()) == {1}
        assert len(backend.unlocked) == 10
        assert backend.deleted == []


async def test_a_requests_end_cancels_its_own_loads_and_no_others(config: ServerConfig) -> None:
    backend = _RecordingLoads()
    await _only_in_l2(config, backend)
    backend.block = True  # every batch hangs in the backend until its request ends
    async with running(config, backend) as (_, worker, scheduler):
        assert (await lookup(scheduler, "a", 6)).hit_chunks == 6
        other = Lookup("b", "m", 1, HASHES[6:10])  # (the server does not check the chain)
        assert (await scheduler.call(other, LookupReply)).hit_chunks == 4
        assert (await cache(worker)).loads_pending == 10
        await scheduler.request(EndSession("a", "m"))
        state = await cache(worker)
        assert (state.loads_pending, state.l1_writing) == (4, 4)  # b's loads go on
        assert sorted(_chunk_of(k) for k in backend.unlocked) == list(range(6))
        await scheduler.request(EndSession("b", "m"))
        state = await cache(worker)
        assert (state.loads_pending, state.l1_writing, state.l1_pins) == (0, 0, 0)
        await await_condition(lambda: backend.statistics()["locks"] == 0, what="L2 unlocked")


async def test_a_corrupt_object_in_a_batch_fails_alone_and_is_deleted(
    config: ServerConfig,
) -> None:
    backend = _RecordingLoads()
    await _only_in_l2(config, backend)
    damaged = next(key for key in backend._objects if _chunk_of(key) == 4)
    data = bytearray(backend._objects[damaged])
    data[-1] ^= 0x01  # a bit flip at rest: the frame's checksum catches it
    backend._objects[damaged] = bytes(data)
    async with running(config, backend) as (_, worker, scheduler):
        assert (await lookup(scheduler, "r")).hit_chunks == 10
        assert await retrieve(worker, "r") == {"read": [0, 1, 2, 3, 5, 6, 7, 8, 9], "failed": [4]}
        assert backend.deleted == [4]
        assert (await cache(worker)).l2_corrupt == 1
        assert set(backend.unlocked.values()) == {1}


async def test_the_first_lookup_after_a_restart_sees_the_whole_disk_l2(
    config: ServerConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: the disk L2's index was built at first use, so a lookup sent as soon as the
    restarted server answered missed everything on disk (here: a scan slower than the lookup
    timeout, as a large L2's is). The server now serves once its backends answered their
    start-up probe."""
    async with running(config, DiskBackend(DiskOptions(path=str(tmp_path)))) as (_, worker, _s):
        await store(worker, "first", 10)
        await written_to_l2(worker, 10)
    real_scan = kvtrio.l2.disk.open_tree

    def slow_scan(*args: Any) -> Any:
        time.sleep(config.lookup_timeout * 2)  # (a large L2: the scan takes a while)
        return real_scan(*args)

    monkeypatch.setattr(kvtrio.l2.disk, "open_tree", slow_scan)
    restarted = DiskBackend(DiskOptions(path=str(tmp_path)))
    async with running(config, restarted) as (_, worker, scheduler):
        # (was: "objects 0" in stats until the first call built the index)
        assert (await stats(worker)).l2[0].counters["objects"] == 10
        assert await lookup(scheduler, "second") == LookupReply(10 * CHUNK, 10)


class _Probed(MemoryBackend):
    """Counts the ``lookup_and_lock`` calls running at once (each takes 10 ms)."""

    def __init__(self) -> None:
        super().__init__()
        self.running = 0
        self.most = 0
        self.calls = 0

    async def lookup_and_lock(self, keys: Sequence[bytes]) -> int:
        if not keys or keys[0][-16:] not in HASHES:  # (the server's start-up probe)
            return await super().lookup_and_lock(keys)
        self.calls += 1
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await trio.sleep(0.01)
            return await super().lookup_and_lock(keys)
        finally:
            self.running -= 1


async def test_wide_lookups_and_batches_probe_a_backend_a_few_at_a_time(
    config: ServerConfig,
) -> None:
    """Issue 22: a lookup started one probe task per rank at once, and a batch all its lookups'
    L2 parts at once (a 32 × 63 batch at world 4096: 131k tasks, 64 s of the loop)."""
    from kvtrio.server.cache._batch import L2_PARTS
    from kvtrio.server.l2tier._loads import RANKS_AT_ONCE

    backend = _Probed()
    config = attrs.evolve(config, lookup_timeout=5.0)
    async with running(config, backend) as (_, _worker, scheduler):
        await scheduler.request(Register("", "w", 64, 0, LAYOUT, HASH_SCHEME_TOKENS))
        wide = await scheduler.call(Lookup("r", "w", 64, HASHES[:2]), LookupReply)
        probes = (backend.calls, backend.most)
        backend.calls = backend.most = 0
        batch = LookupBatch("m", 1, tuple(f"b{i}" for i in range(40)), (HASHES[:1],) * 40)
        reply = await scheduler.call(batch, LookupBatchReply)
    assert wide == LookupReply(0, 0)
    assert probes == (64, RANKS_AT_ONCE)  # every rank, RANKS_AT_ONCE at a time
    assert reply.hit_chunks == (0,) * 40
    assert (backend.calls, backend.most) == (40, L2_PARTS)
