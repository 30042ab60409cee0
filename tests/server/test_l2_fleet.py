"""Servers sharing one L2 store (issue 26): fleet records that report servers naming a model's
chunks otherwise, a backend misconfigured at start, write-through commits, and chunks that an L2
outage kept out of the store written once they are used again."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import pytest
import trio

from kvtrio.config import ServerConfig
from kvtrio.errors import ConfigError
from kvtrio.l2 import BackendMisconfigured, Buffers
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import HASH_SCHEME_TOKENS, Register
from kvtrio.server import open_server
from kvtrio.server.l2tier import _fleet
from kvtrio.server.l2tier._fleet import FleetRecord, record_key
from kvtrio.testing import FaultBackend

from .._support.l2_tier import LAYOUT, running, stats, store
from .._support.waiting import await_async


class SharedMemory(MemoryBackend):
    """A real memory backend that says it is a store other servers share (as Redis and S3
    do); two in-process servers given the same instance share it."""

    shared_store = True

    async def aclose(self) -> None:  # (each server closes it: the store outlives them)
        await trio.lowlevel.checkpoint()


class SlowShared(SharedMemory):
    """Stores take a while, as over a network."""

    async def store(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        await trio.sleep(0.3)
        return await super().store(keys, buffers)


class Misconfigured(MemoryBackend):
    """A backend whose service is not what its options say (every call says so)."""

    async def lookup_and_lock(self, keys: Sequence[bytes]) -> int:
        await trio.lowlevel.checkpoint()
        raise BackendMisconfigured("redis 127.0.0.1:1 is a Redis Cluster node: set cluster=true")


@pytest.fixture
def config(server_config: ServerConfig) -> ServerConfig:
    return attrs.evolve(server_config, lookup_timeout=0.3, retrieve_timeout=2.0)


def _mismatches(client_stats: object) -> float:
    return float(client_stats.l2[0].counters.get("fleet_mismatches", 0))  # type: ignore[attr-defined]


async def _record(shared: SharedMemory) -> FleetRecord | None:
    buffer = bytearray(512)
    found = await shared.load([record_key("m", "")], [[memoryview(buffer)]])
    return FleetRecord.unpack(bytes(buffer)) if found[0] else None


async def test_servers_with_another_chunk_size_are_reported_once(
    config: ServerConfig, caplog: pytest.LogCaptureFixture
) -> None:
    shared = SharedMemory()
    async with running(config, shared) as (server_a, worker_a, _):
        server_a.state.cache.io.l2.fleet.verify_delay = 0.05  # type: ignore[union-attr]

        async def recorded() -> bool:
            return await _record(shared) is not None

        await await_async(recorded, what="the first server's fleet record")
        record = await _record(shared)
        assert record is not None
        assert (record.chunk_size, record.instance) == (256, server_a.instance_id)
        other = attrs.evolve(config, chunk_size=512)
        with caplog.at_level(logging.WARNING, logger="kvtrio.l2"):
            async with running(other, shared) as (_, worker_b, _):

                async def reported() -> bool:
                    return _mismatches(await stats(worker_b)) == 1

                await await_async(reported, what="the mismatch to be reported")
            assert _mismatches(await stats(worker_a)) == 0  # (the first one's record stands)
    warnings = [r for r in caplog.records if getattr(r, "kvtrio_event", "") == "fleet_mismatch"]
    assert len(warnings) == 1
    assert "chunk_size 512 here vs 256 there" in warnings[0].getMessage()
    assert (await _record(shared)).chunk_size == 256  # type: ignore[union-attr]


async def test_servers_that_agree_report_nothing(config: ServerConfig) -> None:
    shared = SharedMemory()
    async with running(config, shared) as (server_a, _, _):
        server_a.state.cache.io.l2.fleet.verify_delay = 0.05  # type: ignore[union-attr]

        async def recorded() -> bool:
            return await _record(shared) is not None

        await await_async(recorded, what="the first server's fleet record")
        async with running(config, shared) as (_, worker_b, _):
            await store(worker_b, "r", 2)  # (a round trip after the record was read)
            assert _mismatches(await stats(worker_b)) == 0


async def test_a_disk_like_backend_of_its_own_gets_no_record(config: ServerConfig) -> None:
    own = MemoryBackend()  # (no shared_store: the server's own, like the disk L2)
    async with running(config, own) as (_, worker, _):
        await store(worker, "r", 1)
        await await_async(
            lambda: _stored(own, 1), what="the chunk written behind"
        )  # (the record would have gone first)
        assert own.statistics()["objects"] == 1


async def _stored(backend: MemoryBackend, count: int) -> bool:
    await trio.lowlevel.checkpoint()
    return backend.statistics()["objects"] >= count


async def test_a_backend_misconfigured_at_start_stops_the_server(config: ServerConfig) -> None:
    expected = "L2 backend redis: redis 127.0.0.1:1 is a Redis Cluster node: set cluster=true"
    with pytest.RaisesGroup(
        pytest.RaisesExc(ConfigError, match=f"^{expected}$"), flatten_subgroups=True
    ):
        async with open_server(config, backends=[("redis", Misconfigured())]):
            pytest.fail("the server started")


@pytest.mark.parametrize("through", [0.0, 5.0])
async def test_write_through_answers_a_commit_once_its_chunks_are_in_l2(
    config: ServerConfig, through: float
) -> None:
    slow = SlowShared()
    async with running(attrs.evolve(config, l2_write_through=through), slow) as (_, worker, _):
        await store(worker, "r", 4)  # returns with the commit's reply
        stored = (await stats(worker)).l2[0].counters.get("stores", 0)
        assert stored == (4 if through else 0)  # (write-behind: still in its 0.3 s store)


async def test_a_chunk_not_written_during_an_outage_is_written_when_used_again(
    config: ServerConfig,
) -> None:
    """A hot prefix that stays in L1 through an L2 outage reaches L2 once it is used again
    (in a fleet, the other servers could never hit it otherwise)."""
    fault = FaultBackend(inner=MemoryBackend())
    async with running(config, fault) as (_, worker, _):
        fault.configure(error_rate=1.0)
        await store(worker, "during", 2)

        async def skipped() -> bool:
            counters = (await stats(worker)).l2[0].counters
            return counters.get("errors", 0) + counters.get("stores_skipped", 0) >= 1

        await await_async(skipped, what="the write-behind to fail")
        assert fault.inner.statistics()["objects"] == 0
        fault.configure(error_rate=0.0)

        async def back() -> bool:
            return (await stats(worker)).l2[0].healthy is True

        await await_async(back, what="the backend probed healthy again")
        await store(worker, "after", 2)  # both chunks are present in L1: used again

        async def written() -> bool:
            await trio.lowlevel.checkpoint()
            return fault.inner.statistics()["objects"] == 2

        await await_async(written, what="the chunks written when used again")


async def test_the_models_checked_are_bounded_in_count_and_bytes(
    config: ServerConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32 item 7: was, with any shared L2, every model name registered kept for the
    server's life (800 registrations of 1 MiB names: +800 MB). Now 32-byte digests, the latest
    ``MAX_SEEN``; and no more than ``MAX_CHECKS`` checks at once (the rest are skipped)."""
    monkeypatch.setattr(_fleet, "MAX_SEEN", 8, raising=False)
    monkeypatch.setattr(_fleet, "MAX_CHECKS", 4, raising=False)
    shared = SharedMemory()
    async with running(config, shared) as (server, worker, _):
        fleet = server.state.cache.io.l2.fleet  # type: ignore[union-attr]
        fleet.verify_delay = 60.0  # (each check stays running, waiting to read back)
        for index in range(20):
            model = f"model-{index}-" + "x" * 1000
            await worker.request(Register("", model, 1, 0, LAYOUT, HASH_SCHEME_TOKENS))
        assert len(fleet._seen) <= 8
        assert all(type(item) is bytes and len(item) == 32 for item in fleet._seen)
        assert fleet.checks <= 4
        assert fleet.skipped >= 20 - 4
