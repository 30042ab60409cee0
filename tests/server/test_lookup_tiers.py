"""Issue 33: a lookup's reply says how many of its hit chunks were in L1 (``l1_chunks``); the
rest the server loads from L2 first, which the engine's load policy weighs apart."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
import trio

from kvtrio.config import ServerConfig
from kvtrio.l2 import Buffers
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import (
    EndSession,
    FreeLookupLocks,
    LookupBatch,
    LookupBatchReply,
    LookupReply,
    Released,
)

from .._support.l2_tier import CHUNK, HASHES, cache, lookup, running, store, written_to_l2
from .._support.waiting import await_condition


@pytest.fixture
def config(server_config: ServerConfig) -> ServerConfig:
    return attrs.evolve(server_config, lookup_timeout=2.0, retrieve_timeout=2.0)


async def test_a_lookup_says_how_much_of_its_hit_is_in_l1(config: ServerConfig) -> None:
    backend = MemoryBackend()
    async with running(config, backend) as (_, worker, scheduler):
        await store(worker, "first", 10)
        found = await lookup(scheduler, "all-l1")
        assert (found.hit_chunks, found.l1_chunks) == (10, 10)
        await written_to_l2(worker, 10)
    async with running(config, backend) as (_, worker, scheduler):  # L1 is empty now
        await store(worker, "again", 4)  # the first 4 chunks are in L1 again
        found = await lookup(scheduler, "split")
        assert (found.hit_chunks, found.l1_chunks) == (10, 4)
    async with running(config, backend) as (_, worker, scheduler):
        await store(worker, "again", 4)
        batch = LookupBatch("m", 1, ("b1", "b2"), (HASHES[:10], HASHES[:2]))
        answered = await scheduler.call(batch, LookupBatchReply)
        assert answered.hit_chunks == (10, 2)
        assert answered.l1_chunks == (4, 2)


class _GatedLookups(MemoryBackend):
    """A memory backend whose lookups wait for the gate while it is set (and count loads)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: trio.Event | None = None
        self.waiting = 0
        self.loads = 0

    async def lookup_and_lock(self, keys: Sequence[bytes]) -> int:
        if self.gate is not None:
            self.waiting += 1
            await self.gate.wait()
        return await super().lookup_and_lock(keys)

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        self.loads += 1
        return await super().load(keys, buffers)


@pytest.mark.parametrize("end", ["end_session", "free_lookup_locks"])
async def test_a_request_ended_during_its_lookups_l2_part_gets_no_loads_and_no_pins(
    config: ServerConfig, end: str
) -> None:
    """Was: the L2 part went on after the request's end, started the loads and pinned the
    loaded chunks for a request nobody would end again (held until ``pin_ttl``)."""
    backend = _GatedLookups()
    async with running(config, backend) as (_, worker, _scheduler):
        await store(worker, "first", 10)
        await written_to_l2(worker, 10)
    async with running(config, backend) as (_, worker, scheduler):  # L1 is empty now
        backend.gate = trio.Event()
        replies: list[LookupReply] = []

        async def look() -> None:
            replies.append(await lookup(scheduler, "r"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(look)
            await await_condition(lambda: backend.waiting == 1, what="the L2 lookup to wait")
            ending = EndSession("r", "m") if end == "end_session" else FreeLookupLocks("r", "m")
            assert (await scheduler.call(ending, Released)).released == 0
            backend.gate.set()
        assert replies == [LookupReply(0, 0, 0)]
        state = await cache(worker)
        assert (state.l1_pins, state.leases, state.loads_pending) == (0, 0, 0)
        assert backend.loads == 0
        backend.gate = None
        assert await lookup(scheduler, "again") == LookupReply(10 * CHUNK, 10, 0)  # (unlocked)
