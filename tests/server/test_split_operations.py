"""A worker's store or retrieve split into several requests over consecutive chunk ranges (as
the CPU worker adapter pipelines them): the chunks link to their prefix as in one request, and
the retrieves wait for the request's L2 loads once, not once each."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
import trio

from kvtrio.client import AsyncClient
from kvtrio.config import ServerConfig
from kvtrio.errors import BadRequest
from kvtrio.l2 import Buffers
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import (
    Commit,
    EndSession,
    LookupReply,
    Retrieve,
    RetrieveReply,
    Store,
    StoreReply,
)

from .._support.l2_tier import (
    CHUNK,
    HASHES,
    ParentsBackend,
    cache,
    lookup,
    running,
    store,
    written_to_l2,
)
from .._support.waiting import await_async


@pytest.fixture
def config(server_config: ServerConfig) -> ServerConfig:
    return attrs.evolve(server_config, lookup_timeout=5.0, retrieve_timeout=1.0)


async def test_a_store_in_parts_links_each_parts_first_chunk_to_its_parent_hash(
    config: ServerConfig,
) -> None:
    backend = ParentsBackend()
    async with running(config, backend) as (_, worker, _scheduler):
        for start, end in [(0, 1), (1, 3), (3, 10)]:
            reply = await worker.call(
                Store(
                    "a",
                    start * CHUNK,
                    end * CHUNK,
                    HASHES[start:end],
                    parent_hash=HASHES[start - 1] if start else b"",
                ),
                StoreReply,
            )
            assert [slot.status for slot in reply.slots] == ["write"] * (end - start)
            await worker.request(Commit("a", written=HASHES[start:end]))
        await written_to_l2(worker, 10)
        with pytest.raises(BadRequest, match="parent_hash"):
            await worker.request(Store("b", CHUNK, 2 * CHUNK, HASHES[1:2], parent_hash=b"x"))
    assert len(backend.parents) == 10
    for key, parent in backend.parents.items():
        space, chunk = key[: -len(HASHES[0])], HASHES.index(key[-len(HASHES[0]) :])
        assert parent == (None if chunk == 0 else space + HASHES[chunk - 1])


class _StuckLoads(MemoryBackend):
    """A memory backend whose loads wait until released (a stalled remote store)."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck = False
        self.release = trio.Event()

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        if self.stuck:
            await self.release.wait()
        return await super().load(keys, buffers)


async def test_retrieves_of_one_request_share_one_wait_for_its_stalled_loads(
    config: ServerConfig,
) -> None:
    backend = _StuckLoads()
    async with running(config, backend) as (_, worker, _scheduler):
        await store(worker, "first", 10)
        await written_to_l2(worker, 10)
    async with running(config, backend) as (_, worker, scheduler):  # L1 is empty now
        backend.stuck = True
        assert await lookup(scheduler, "r") == LookupReply(10 * CHUNK, 10)
        replies: dict[int, RetrieveReply] = {}

        async def part(start: int, end: int) -> None:
            request = Retrieve("r", start * CHUNK, end * CHUNK, HASHES[start:end])
            replies[start] = await worker.call(request, RetrieveReply)

        started = trio.current_time()
        async with trio.open_nursery() as nursery:  # five requests in flight at once
            for start in range(0, 10, 2):
                nursery.start_soon(part, start, start + 2)
                await trio.lowlevel.checkpoint()
        waited = trio.current_time() - started
        # Each alone would wait retrieve_timeout; together they share it (5 s before).
        assert config.retrieve_timeout <= waited < 3 * config.retrieve_timeout
        assert all(s.status == "failed" for r in replies.values() for s in r.slots)
        await scheduler.request(EndSession("r", "m"))  # cancels the loads
        backend.release.set()
        state = await cache(worker)
        assert (state.l1_pins, state.leases) == (0, 0)


class _GatedLoads(MemoryBackend):
    """A memory backend whose loads of some chunks wait until the gate opens."""

    def __init__(self) -> None:
        super().__init__()
        self.held: set[bytes] = set()  # chunk hashes
        self.gate = trio.Event()

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        if any(key[-len(HASHES[0]) :] in self.held for key in keys):
            await self.gate.wait()
        return await super().load(keys, buffers)


async def partial(worker: AsyncClient, start: int) -> list[str]:
    request = Retrieve("r", start * CHUNK, 10 * CHUNK, HASHES[start:], partial=True)
    reply = await worker.call(request, RetrieveReply)
    assert [slot.chunk for slot in reply.slots] == list(range(start, 10))
    return [slot.status for slot in reply.slots]


@pytest.mark.parametrize("opens", [True, False])
async def test_a_partial_retrieve_answers_the_loaded_chunks_and_the_rest_as_loading(
    config: ServerConfig, opens: bool
) -> None:
    backend = _GatedLoads()
    config = attrs.evolve(config, l2_loaders=10)  # every load runs: the held ones wait
    async with running(config, backend) as (_, worker, _scheduler):
        await store(worker, "first", 10)
        await written_to_l2(worker, 10)
    async with running(config, backend) as (_, worker, scheduler):
        backend.held = set(HASHES[3:])
        assert await lookup(scheduler, "r") == LookupReply(10 * CHUNK, 10)

        async def three_loaded() -> bool:
            return bool((await cache(worker)).loads_pending == 7)

        await await_async(three_loaded, what="chunks 0-2 loaded")
        assert await partial(worker, 0) == ["read"] * 3 + ["loading"] * 7  # at once
        started = trio.current_time()
        if opens:

            async def open_gate() -> None:
                await trio.sleep(0.2)
                backend.gate.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(open_gate)
                statuses = await partial(worker, 3)  # waits for chunk 3
            assert statuses[0] == "read"
            while "loading" in statuses:  # (the rest may or may not be loaded by then)
                start = 10 - len(statuses) + statuses.index("loading")
                statuses = await partial(worker, start)
            assert "failed" not in statuses
        else:  # the loads never end: the request's wait does, and the rest fails
            assert await partial(worker, 3) == ["failed"] * 7
            assert trio.current_time() - started >= config.retrieve_timeout
            backend.gate.set()
        await scheduler.request(EndSession("r", "m"))
        state = await cache(worker)
        assert state.leases == (10 if opens else 3)  # one read lease per chunk read
