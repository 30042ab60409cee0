"""Issue 33: a lookup's reply says how many of its hit chunks were in L1 (``l1_chunks``); the
rest the server loads from L2 first, which the engine's load policy weighs apart."""

from __future__ import annotations

import attrs
import pytest

from kvtrio.config import ServerConfig
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import LookupBatch, LookupBatchReply

from .._support.l2_tier import HASHES, lookup, running, store, written_to_l2


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
