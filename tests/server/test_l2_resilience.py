"""Issue 11: the server outlives its backends — whatever they raise, whatever their disk does."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
import trio

from kvtrio.config import ServerConfig
from kvtrio.errors import ConfigError
from kvtrio.l2 import BackendUnavailable, Buffers
from kvtrio.l2.disk import DiskBackend, DiskOptions
from kvtrio.l2.memory import MemoryBackend
from kvtrio.options import ByteSize
from kvtrio.protocol import EndSession, LookupReply
from kvtrio.testing import FaultBackend

from .._support.l2_tier import CHUNK, cache, lookup, retrieve, running, stats, store, written_to_l2
from .._support.waiting import await_async, await_condition


@pytest.fixture
def config(server_config: ServerConfig) -> ServerConfig:
    return attrs.evolve(server_config, lookup_timeout=2.0, retrieve_timeout=2.0)


async def test_a_disk_l2_whose_directory_became_a_file_does_not_stop_the_server(
    config: ServerConfig, tmp_path: Path
) -> None:
    """Was: the eviction's unlink raised NotADirectoryError and the server exited."""
    root = tmp_path / "l2"
    disk = DiskBackend(DiskOptions(path=str(root), capacity=ByteSize(3 * 300_000)))
    async with running(config, disk) as (_, worker, scheduler):
        await store(worker, "a", 3)
        await written_to_l2(worker, 3)
        shutil.rmtree(root)
        root.write_bytes(b"not a directory any more")  # the real fault, no injection
        await store(worker, "b", 8)  # write-behind must evict, and every file operation fails

        async def failed() -> bool:
            return (await stats(worker)).l2[0].counters.get("errors", 0) >= 1

        await await_async(failed, what="the failed writes to be counted")
        assert (await stats(worker)).l2[0].healthy is False
        assert await lookup(scheduler, "c", 8) == LookupReply(8 * CHUNK, 8)  # L1 still serves


class _Buggy(MemoryBackend):
    """A plugin with a bug: every operation raises ``exception`` while ``broken``."""

    def __init__(self, exception: BaseException) -> None:
        super().__init__()
        self.exception = exception
        self.broken = False

    def _maybe_fail(self) -> None:
        if self.broken:
            raise self.exception

    async def lookup_and_lock(self, keys: Sequence[bytes]) -> int:
        self._maybe_fail()
        return await super().lookup_and_lock(keys)

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        self._maybe_fail()
        return await super().load(keys, buffers)

    async def store(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        self._maybe_fail()
        return await super().store(keys, buffers)

    async def unlock(self, keys: Sequence[bytes]) -> None:
        self._maybe_fail()
        await super().unlock(keys)


@pytest.mark.parametrize(
    "exception",
    [TypeError("bug"), OSError(5, "Input/output error"), KeyError("x"), ValueError("bad")],
    ids=["TypeError", "EIO", "KeyError", "ValueError"],
)
async def test_any_exception_of_a_plugin_is_a_backend_error_not_a_dead_server(
    config: ServerConfig, exception: BaseException
) -> None:
    buggy = _Buggy(exception)
    async with running(config, buggy) as (_, worker, scheduler):
        await store(worker, "a", 4)
        await written_to_l2(worker, 4)
        buggy.broken = True
        await store(worker, "b", 6)  # the write-behind of chunks 4, 5 fails
        assert await lookup(scheduler, "c", 6) == LookupReply(6 * CHUNK, 6)  # L1 only
        await scheduler.request(EndSession("c", "m"))

        async def failed() -> bool:
            return (await stats(worker)).l2[0].counters.get("errors", 0) >= 1

        await await_async(failed, what="the failures to be counted")
        assert (await stats(worker)).l2[0].healthy is False
    async with running(config, buggy) as (_, worker, scheduler):  # L1 empty: L2 or nothing
        assert await lookup(scheduler, "d", 4) == LookupReply(0, 0)  # a miss, not an error
        buggy.broken = False

        async def healthy() -> bool:
            return bool((await stats(worker)).l2[0].healthy)

        await await_async(healthy, what="the backend to be used again")
        assert (await lookup(scheduler, "e", 4)).hit_chunks == 4


class _Malformed(MemoryBackend):
    """A plugin with a bug in the shape of its answers: its stores answer one result too few
    or one too many, and its statistics hold a value that is not a number."""

    def __init__(self, extra: int) -> None:
        super().__init__()
        self.extra = extra
        self.stores = 0

    async def store(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        results = await super().store(keys, buffers)
        self.stores += 1
        return results[:-1] if self.extra < 0 else results + [True] * self.extra

    def statistics(self) -> dict[str, float]:
        return {**super().statistics(), "mood": "fine"}  # type: ignore[dict-item]


@pytest.mark.parametrize("extra", [-1, 1], ids=["too few", "too many"])
async def test_a_store_answered_with_the_wrong_number_of_results_is_a_backend_error(
    config: ServerConfig, extra: int
) -> None:
    """Was: the write-behind's zip of keys and results raised outside the backend call, and
    the server died."""
    malformed = _Malformed(extra)
    async with running(config, malformed) as (_, worker, scheduler):
        await store(worker, "a", 3)

        async def failed() -> bool:
            return (await stats(worker)).l2[0].counters.get("errors", 0) >= 1

        await await_async(failed, what="the malformed answer to be counted")
        reply = await stats(worker)
        assert reply.l2[0].healthy is False
        assert "mood" not in reply.l2[0].counters  # (a plugin's non-number: left out)
        assert malformed.stores >= 1
        assert await lookup(scheduler, "c", 3) == LookupReply(3 * CHUNK, 3)  # L1 still serves


class _FlakyLoads(MemoryBackend):
    """Loads fail (a transient error) ``failures`` times, then work."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        if self.failures:
            self.failures -= 1
            raise BackendUnavailable("transient")
        return await super().load(keys, buffers)


async def test_a_transient_load_error_keeps_the_object(config: ServerConfig) -> None:
    """Was: the failed load was counted `unreadable` and the good object deleted."""
    flaky = _FlakyLoads(failures=0)
    async with running(config, flaky) as (_, worker, _scheduler):
        await store(worker, "a", 1)
        await written_to_l2(worker, 1)
    flaky.failures = 1
    async with running(config, flaky) as (_, worker, scheduler):
        assert (await lookup(scheduler, "r", 1)).hit_chunks == 1
        assert await retrieve(worker, "r", 1) == {"failed": [0]}
        await scheduler.request(EndSession("r", "m"))
        assert flaky.statistics()["objects"] == 1  # still there
        counters = (await stats(worker)).l2[0].counters
        assert counters.get("unreadable", 0) == 0
    async with running(config, flaky) as (_, worker, scheduler):
        assert (await lookup(scheduler, "r2", 1)).hit_chunks == 1
        assert await retrieve(worker, "r2", 1) == {"read": [0]}


class _Dead(MemoryBackend):
    """A service that cannot be reached (like ``redis://127.0.0.1:1``)."""

    async def lookup_and_lock(self, keys: Sequence[bytes]) -> int:
        raise BackendUnavailable("connection refused")


class _Silent(MemoryBackend):
    """A service that never answers."""

    async def lookup_and_lock(self, keys: Sequence[bytes]) -> int:
        await trio.sleep_forever()
        raise AssertionError


async def test_a_dead_backend_is_reported_at_start_up_not_healthy(
    config: ServerConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: `healthy: true` and no warning until traffic arrived (issue 15, item 5)."""
    caplog.set_level(logging.WARNING, logger="kvtrio.l2")
    async with running(config, _Dead()) as (_, worker, _scheduler):

        async def reported() -> bool:
            return (await stats(worker)).l2[0].healthy is False

        await await_async(reported, what="the start-up probe to fail")
        await await_condition(
            lambda: any("connection refused" in r.getMessage() for r in caplog.records),
            what="a warning",
        )


async def test_a_backend_that_has_not_answered_has_unknown_health(config: ServerConfig) -> None:
    async with running(config, _Silent()) as (_, worker, _scheduler):
        assert (await stats(worker)).l2[0].healthy is None
    async with running(config, MemoryBackend()) as (_, worker, _scheduler):

        async def known() -> bool:
            return (await stats(worker)).l2[0].healthy is True

        await await_async(known, what="the probe to answer")
        assert (await cache(worker)).lookups == 0  # the probe is no request


async def test_a_disk_l2_path_that_cannot_be_created_stops_the_start_in_one_line(
    config: ServerConfig, tmp_path: Path
) -> None:
    """Was (issue 22): started fine, L2 silently unusable while stats said `healthy: true`;
    then (issue 32): it started and served with the L2 skipped for ever. A local path that can
    never work is a bad setting like any other: the start stops with its one line."""
    (tmp_path / "file").write_text("x")
    disk = DiskBackend(DiskOptions(path=str(tmp_path / "file" / "l2")))
    with pytest.RaisesGroup(
        pytest.RaisesExc(ConfigError, match=r"disk: cannot use .*: Not a directory; set path="),
        flatten_subgroups=True,
    ):
        async with running(config, disk):
            pytest.fail("the server started")


async def test_the_write_behind_queue_pins_at_most_a_quarter_of_l1(
    config: ServerConfig,
) -> None:
    config = attrs.evolve(config, l1_size=ByteSize(2 << 20))  # 8 chunks of 256 KiB
    slow = FaultBackend(inner=MemoryBackend())
    slow.configure(latency=0.5)
    async with running(config, slow) as (_, worker, _scheduler):
        await store(worker, "a", 6)  # committed at once: 2 fit in 512 KiB, 4 are skipped
        state = await cache(worker)
        assert state.write_behind_skipped == 4
        await written_to_l2(worker, 2)
        assert (await cache(worker)).l1_pins == 0
