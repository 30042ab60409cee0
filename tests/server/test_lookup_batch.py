"""``lookup_batch``: several lookups in one message answer as the same lookups one by one."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel

from kvtrio.client import open_client
from kvtrio.config import ServerConfig
from kvtrio.errors import BadRequest
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    MAX_HASHES,
    MAX_LOOKUP_BATCH,
    MAX_LOOKUP_KEYS,
    Commit,
    EndSession,
    Lookup,
    LookupBatch,
    LookupBatchReply,
    LookupFailure,
    LookupReply,
    Register,
    Store,
    StoreReply,
)
from kvtrio.server import open_server
from kvtrio.storage import token_chunk_hashes
from kvtrio.testing import FaultBackend

from .._support.l2_tier import CHUNK, HASHES, LAYOUT, cache, running, store, written_to_l2
from .._support.waiting import await_condition


@pytest.fixture
def config(server_config: ServerConfig) -> ServerConfig:
    return attrs.evolve(server_config, lookup_timeout=0.3, retrieve_timeout=2.0)


async def test_a_batch_answers_and_pins_as_its_lookups_one_by_one(config: ServerConfig) -> None:
    async with running(config, MemoryBackend()) as (_, worker, scheduler):
        await store(worker, "stored", 6)
        await written_to_l2(worker, 6)  # (the write-behind pins them until then)
        prompts = (HASHES[:8], HASHES[:2], (b"\x01" * 16,), ())  # 6 in L1, 2, unknown, empty
        batch = LookupBatch("m", 1, ("a", "b", "c", "d"), prompts)
        reply = await scheduler.call(batch, LookupBatchReply)
        assert reply == LookupBatchReply((6 * CHUNK, 2 * CHUNK, 0, 0), (6, 2, 0, 0))
        pins = (await cache(worker)).l1_pins
        singles = [
            await scheduler.call(Lookup(f"s{i}", "m", 1, p), LookupReply)
            for i, p in enumerate(prompts)
        ]
        assert [(s.hit_tokens, s.hit_chunks) for s in singles] == list(
            zip(reply.hit_tokens, reply.hit_chunks, strict=True)
        )
        assert (await cache(worker)).l1_pins == 2 * pins  # the same pins again
        for request in ("a", "b", "s0", "s1"):
            await scheduler.request(EndSession(request, "m"))
        assert (await cache(worker)).l1_pins == 0


async def test_a_failed_lookup_is_reported_and_the_others_answer(config: ServerConfig) -> None:
    async with running(config, MemoryBackend()) as (_, worker, scheduler):
        await store(worker, "stored", 2)
        batch = LookupBatch("m", 1, ("a", "bad", "c"), (HASHES[:2], (b"short",), HASHES[:1]))
        reply = await scheduler.call(batch, LookupBatchReply)
        assert reply.hit_chunks == (2, 0, 1)
        assert len(reply.failed) == 1
        assert reply.failed[0].index == 1
        assert reply.failed[0].code == "bad_request"
        assert reply.failed[0] == LookupFailure(1, "bad_request", reply.failed[0].message)


async def test_a_batch_whose_arrays_differ_in_length_is_a_bad_request(
    config: ServerConfig,
) -> None:
    async with running(config, MemoryBackend()) as (_, _worker, scheduler):
        with pytest.raises(BadRequest):
            await scheduler.request(LookupBatch("m", 1, ("a", "b"), (HASHES[:1],)))


async def test_a_batch_that_names_a_request_twice_is_a_bad_request(config: ServerConfig) -> None:
    """Lookup j of a request would replace lookup i's pins before i's L2 part even started."""
    async with running(config, MemoryBackend()) as (_, worker, scheduler):
        batch = LookupBatch("m", 1, ("a", "b", "a"), (HASHES[:1], HASHES[:2], HASHES[:1]))
        with pytest.raises(BadRequest, match="appears twice"):
            await scheduler.request(batch)
        assert (await cache(worker)).l1_pins == 0


async def test_a_batch_beyond_the_bound_is_a_bad_request_that_says_the_bound(
    config: ServerConfig,
) -> None:
    count = MAX_LOOKUP_BATCH + 1
    async with running(config, MemoryBackend()) as (_, _worker, scheduler):
        batch = LookupBatch("m", 1, tuple(f"r{i}" for i in range(count)), ((),) * count)
        with pytest.raises(BadRequest, match=f"at most {MAX_LOOKUP_BATCH}"):
            await scheduler.request(batch)
        full = LookupBatch("m", 1, tuple(f"r{i}" for i in range(count - 1)), ((),) * (count - 1))
        reply = await scheduler.call(full, LookupBatchReply)
        assert reply.hit_chunks == (0,) * (count - 1)


async def test_the_l2_parts_of_a_batch_run_together(config: ServerConfig) -> None:
    config = attrs.evolve(config, lookup_timeout=5.0)
    fault = FaultBackend(inner=MemoryBackend())
    prompts = [HASHES, tuple(token_chunk_hashes(range(90_000, 90_000 + 10 * CHUNK), CHUNK))]
    async with running(config, fault) as (_, worker, scheduler):
        for index, hashes in enumerate(prompts):
            reply = await worker.call(Store(f"p{index}", 0, 10 * CHUNK, hashes), StoreReply)
            await worker.request(Commit(f"p{index}", written=tuple(hashes)))
            assert [slot.status for slot in reply.slots] == ["write"] * 10
        await written_to_l2(worker, 20)
    async with running(config, fault) as (_, worker, scheduler):  # L1 is empty now
        fault.configure(latency=0.5)  # each L2 lookup takes 0.5 s: together, not in turn
        batch = LookupBatch("m", 1, ("a", "b", "c"), (prompts[0], prompts[1], HASHES[:0]))
        started = trio.current_time()
        reply = await scheduler.call(batch, LookupBatchReply)
        assert trio.current_time() - started < 2 * 0.5
        assert reply == LookupBatchReply((10 * CHUNK, 10 * CHUNK, 0), (10, 10, 0))
        for request in ("a", "b"):
            await scheduler.request(EndSession(request, "m"))
        await await_condition(lambda: fault.statistics()["locks"] == 0, what="L2 unlocked")


# --------------------------------------------------------------------------- issue 22


async def test_a_malformed_hash_list_fails_its_own_lookup_and_says_what_is_wrong(
    config: ServerConfig,
) -> None:
    """Was: one list with a non-binary element refused the whole batch ("expected an array of
    binary values, got an array"), without saying which lookup."""
    async with running(config, MemoryBackend()) as (_, worker, scheduler):
        await store(worker, "stored", 2)
        too_many = tuple(i.to_bytes(16, "little") for i in range(MAX_HASHES + 1))
        lists: tuple[Any, ...] = (HASHES[:2], (HASHES[0], 7), "not an array", too_many, HASHES[:1])
        batch = LookupBatch("m", 1, ("a", "int", "str", "long", "e"), lists)
        reply = await scheduler.call(batch, LookupBatchReply)
        assert reply.hit_chunks == (2, 0, 0, 0, 1)
        failed = {failure.index: failure for failure in reply.failed}
        assert sorted(failed) == [1, 2, 3]
        assert {failure.code for failure in reply.failed} == {"bad_request"}
        assert "the one at index 1 is a int" in failed[1].message
        assert "expected an array of binary values, got str" in failed[2].message
        assert f"at most {MAX_HASHES} chunk hashes" in failed[3].message
        for request in ("a", "e"):
            await scheduler.request(EndSession(request, "m"))


class _LookupsPerStep(trio.abc.Instrument):
    """The most lookups the server answered within one task step (of any task)."""

    def __init__(self, lookups: Any) -> None:
        self.lookups = lookups
        self.before = 0
        self.most = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.before = self.lookups.lookups

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.most = max(self.most, self.lookups.lookups - self.before)


async def test_a_large_batch_yields_to_the_event_loop_between_slices(
    server_config: ServerConfig,
) -> None:
    """Was: a batch ran all its lookups in one step of the router (1,024 × 880 hashes: 6 s in
    which no other client was answered). Now a batch of more than SLICE_KEYS keys yields after
    each slice: no task step answers more than a slice's lookups."""
    from kvtrio.server.cache._batch import SLICE_KEYS

    lookups, per = MAX_LOOKUP_BATCH, MAX_LOOKUP_KEYS // MAX_LOOKUP_BATCH
    requests = tuple(f"r{i}" for i in range(lookups))
    hashes = tuple(
        tuple((i * per + j).to_bytes(16, "little") for j in range(per)) for i in range(lookups)
    )
    async with open_server(server_config) as server, open_client(server.endpoint) as client:
        await client.request(Register("", "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS))
        counter = _LookupsPerStep(server.state.cache.lookups)  # type: ignore[union-attr]
        trio.lowlevel.add_instrument(counter)
        try:
            reply = await client.call(LookupBatch("m", 1, requests, hashes), LookupBatchReply)
        finally:
            trio.lowlevel.remove_instrument(counter)
        assert reply.hit_chunks == (0,) * lookups
        assert not reply.failed
        assert counter.lookups.lookups == lookups
        assert 0 < counter.most <= SLICE_KEYS // per
        server.stop()
