"""L2 admission in a real server over memory and disk L2s (``--l2-admission``): what reaches
L2 with ``reuse`` and ``all``, and the counters. The decisions alone: ``test_l2_admission.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest

from kvtrio.client import AsyncClient
from kvtrio.config import ServerConfig
from kvtrio.l2.disk import DiskBackend, DiskOptions
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import Commit, EndSession, Lookup, LookupReply, Store, StoreReply
from kvtrio.server._metrics import families_from_stats
from kvtrio.storage import token_chunk_hashes

from .._support.l2_tier import CHUNK, HASHES, cache, lookup, running, stats, written_to_l2


@pytest.fixture
def reuse(server_config: ServerConfig) -> ServerConfig:
    return attrs.evolve(server_config, l2_admission="reuse", lookup_timeout=2.0)


async def store_hashes(worker: AsyncClient, request: str, hashes: Sequence[bytes]) -> int:
    """Store (and commit) the chunks of ``hashes`` as one prompt; how many were written."""
    reply = await worker.call(Store(request, 0, len(hashes) * CHUNK, tuple(hashes)), StoreReply)
    written = tuple(hashes[slot.chunk] for slot in reply.slots if slot.status == "write")
    await worker.request(Commit(request, written=written))
    return len(written)


async def lookup_then_store(
    worker: AsyncClient, scheduler: AsyncClient, request: str, chunks: int
) -> None:
    """What an engine does for a prompt of ``chunks`` chunks: look it up, store the rest, end
    the request (its lookup's pins go)."""
    await lookup(scheduler, request, chunks)
    await store_hashes(worker, request, HASHES[:chunks])
    await scheduler.request(EndSession(request, "m"))


async def test_with_reuse_a_chunk_stored_once_is_not_written_and_is_counted(
    reuse: ServerConfig,
) -> None:
    backend = MemoryBackend()
    async with running(reuse, backend) as (_, worker, scheduler):
        await lookup_then_store(worker, scheduler, "once", 10)
        reply = await stats(worker)
        state = reply.cache
        assert state is not None
        # Refused at the commit, synchronously: nothing was queued, so nothing can be written.
        assert (state.l2_admitted, state.l2_refused, state.l2_admitted_later) == (0, 10, 0)
        assert (state.write_behind_queued, state.l1_pins) == (0, 0)
        assert reply.l2[0].counters.get("stores", 0) == 0
        assert backend.statistics()["objects"] == 0
        (family,) = [
            f for f in families_from_stats(reply) if f.name == "kvtrio_l2_admission_chunks"
        ]
        by_decision = {s.labels["decision"]: s.value for s in family.samples}
        assert by_decision == {"admitted": 0, "refused": 10, "admitted_later": 0}


async def test_with_all_every_chunk_is_written_as_before(server_config: ServerConfig) -> None:
    backend = MemoryBackend()
    async with running(server_config, backend) as (_, worker, scheduler):
        await lookup_then_store(worker, scheduler, "once", 10)
        await written_to_l2(worker, 10)
        state = await cache(worker)
        assert (state.l2_admitted, state.l2_refused, state.l2_admitted_later) == (10, 0, 0)
        assert backend.statistics()["objects"] == 10


async def test_a_chunk_looked_up_again_while_in_l1_is_written_and_survives_a_restart(
    reuse: ServerConfig, short_dir: Path
) -> None:
    disk = DiskOptions(path=short_dir / "l2")
    async with running(reuse, DiskBackend(disk)) as (_, worker, scheduler):
        await lookup_then_store(worker, scheduler, "first", 10)
        assert (await cache(worker)).l2_refused == 10
        assert await lookup(scheduler, "again", 10) == LookupReply(10 * CHUNK, 10)  # L1 hits
        await written_to_l2(worker, 10)  # admitted later, parents first
        state = await cache(worker)
        assert (state.l2_admitted, state.l2_refused, state.l2_admitted_later) == (0, 10, 10)
    async with running(reuse, DiskBackend(disk)) as (_, worker, scheduler):  # L1 is empty now
        assert await lookup(scheduler, "after a restart", 10) == LookupReply(10 * CHUNK, 10)
        assert (await cache(worker)).lookup_l2_chunks == 10


async def test_a_chunk_another_request_looked_up_is_written_at_its_commit(
    reuse: ServerConfig,
) -> None:
    backend = MemoryBackend()
    async with running(reuse, backend) as (_, worker, scheduler):
        await lookup(scheduler, "earlier", 10)  # (missed: nobody stored it)
        await lookup_then_store(worker, scheduler, "now", 10)
        await written_to_l2(worker, 10)
        state = await cache(worker)
        assert (state.l2_admitted, state.l2_refused) == (10, 0)


async def test_a_conversations_history_reaches_l2_before_l1_evicts_it(
    reuse: ServerConfig,
) -> None:
    """Turn 1 (4 chunks) is refused; turn 2's lookup hits it in L1, so it is written, and turn
    2's new chunks continue a reused prefix, so they are written at their commit. Other
    prompts then fill L1 (40 chunks; the write-behind queue takes a quarter, 10): turn 3
    finds all 8 chunks in L2. (LRU: arc would keep the conversation, used twice, over the
    prompts used once.)"""
    config = attrs.evolve(reuse, l1_size=40 * (256 << 10), eviction="lru")
    backend = MemoryBackend()
    async with running(config, backend) as (_, worker, scheduler):
        await lookup_then_store(worker, scheduler, "turn 1", 4)
        assert (await cache(worker)).l2_refused == 4
        await lookup_then_store(worker, scheduler, "turn 2", 8)
        await written_to_l2(worker, 8)
        state = await cache(worker)
        assert (state.l2_admitted, state.l2_refused, state.l2_admitted_later) == (4, 4, 4)
        for other in range(5):  # 50 chunks of other one-off prompts through a 40-chunk L1
            tokens = tuple(range(100_000 * (other + 1), 100_000 * (other + 1) + 10 * CHUNK))
            hashes = token_chunk_hashes(tokens, CHUNK)
            await scheduler.call(Lookup(f"other {other}", "m", 1, tuple(hashes)), LookupReply)
            await store_hashes(worker, f"other {other}", hashes)
            await scheduler.request(EndSession(f"other {other}", "m"))
        state = await cache(worker)
        assert state.l1_evictions >= 8
        assert state.l2_refused == 4 + 50  # (seen once: not written)
        assert await lookup(scheduler, "turn 3", 8) == LookupReply(8 * CHUNK, 8)
        assert (await cache(worker)).lookup_l2_chunks == 8


class SharedMemoryBackend(MemoryBackend):
    """A memory backend that says other servers share it (as redis and s3 do)."""

    shared_store = True


@pytest.mark.parametrize(
    ("backend_class", "written"), [(MemoryBackend, 0), (SharedMemoryBackend, 6)]
)
async def test_auto_is_reuse_unless_a_backend_is_shared(
    server_config: ServerConfig, backend_class: type[MemoryBackend], written: int
) -> None:
    config = attrs.evolve(server_config, l2_admission="auto")
    async with running(config, backend_class()) as (_, worker, scheduler):
        await lookup_then_store(worker, scheduler, "once", 6)
        if written:
            await written_to_l2(worker, written)
        state = await cache(worker)
        assert (state.l2_admitted, state.l2_refused) == (written, 6 - written)
