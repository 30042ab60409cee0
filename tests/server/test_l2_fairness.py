"""Tenants share the L2 fairly (issue 22, item 4): one tenant's flood neither evicts another's
L2 objects below its share nor starves its write-behind. Real server, real CURVE tenants."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from kvtrio.client import AsyncClient
from kvtrio.config import BackendSpec
from kvtrio.l2 import Buffers
from kvtrio.l2._diskio import record_size
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import GetStats, Lookup, LookupReply, StatsReply
from kvtrio.shm import SharedArena

from .._support.tenants import (
    ARENA_CHUNKS,
    CHUNK_BYTES,
    hashes,
    register,
    store,
    tcp_config,
    tenant_clients,
)
from .._support.waiting import await_async

ACME_FILL, FLOOD_FILL = 0x3C, 0x11


async def _stored(client: AsyncClient, count: int) -> None:
    async def done() -> bool:
        reply = await client.call(GetStats(), StatsReply)
        return reply.l2[0].counters.get("stores", 0) >= count

    await await_async(done, what=f"{count} chunks written to L2")


async def test_a_tenants_flood_does_not_evict_anothers_l2_objects(short_dir: Path) -> None:
    """Was: B's 200 chunks evicted every one of A's L2 objects (0 of 8 after a restart)."""
    capacity = 24 * record_size(CHUNK_BYTES + 72)  # (72: the frame header)
    config = tcp_config(
        l1_size=2 * ARENA_CHUNKS * CHUNK_BYTES,
        l1_tenants=2,
        l2=(BackendSpec("disk", {"path": str(short_dir / "l2"), "capacity": str(capacity)}),),
        lookup_timeout=5.0,
    )
    kept = hashes(7, 8)
    async with tenant_clients(short_dir, config) as (server, acme, flood):
        mine = await register(acme, "acme")
        theirs = await register(flood, "victim")
        a_arena = SharedArena.attach(mine.arena_path, mine.arena_size, populate=False)
        b_arena = SharedArena.attach(theirs.arena_path, theirs.arena_size, populate=False)
        try:
            assert await store(acme, a_arena, "k", kept, ACME_FILL) == 8
            await _stored(acme, 8)
            for batch in range(25):  # 200 chunks, each batch written before the next
                await store(flood, b_arena, f"f{batch}", hashes(100 + batch, 8), FLOOD_FILL)
                await _stored(flood, 8 * (batch + 2))
        finally:
            a_arena.close()
            b_arena.close()
        server.stop()
    async with tenant_clients(short_dir, config) as (server, acme, _flood):
        await register(acme, "acme")
        found = await acme.call(
            Lookup("k2", "m", 1, chunk_hashes=kept, tenant="acme", engine="w"), LookupReply
        )
        assert found.hit_chunks == 8  # all of A's chunks are still in L2 after the restart
        disk = (await acme.call(GetStats(), StatsReply)).l2[0].counters
        assert disk["owners"] == 2
        server.stop()


class _Gated(MemoryBackend):
    """A memory backend whose stores wait for :attr:`gate`; remembers each stored chunk's
    first byte (the tenant's fill)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = trio.Event()
        self.fills: list[int] = []

    async def store(  # type: ignore[override]
        self, keys: Sequence[bytes], buffers: Sequence[Buffers], **_: Any
    ) -> list[bool]:
        await self.gate.wait()
        self.fills += [parts[-1][0] for parts in buffers]
        return await super().store(keys, buffers)

    def statistics(self) -> Mapping[str, float]:
        return {}


async def test_a_tenants_commit_flood_does_not_starve_anothers_write_behind(
    short_dir: Path,
) -> None:
    """Was: while the flood held the queue, every one of A's committed chunks was skipped."""
    config = tcp_config(l1_size=2 * ARENA_CHUNKS * CHUNK_BYTES, l1_tenants=2, write_behind_queue=16)
    gated = _Gated()
    async with tenant_clients(short_dir, config, [("l2", gated)]) as (server, acme, flood):
        mine = await register(acme, "acme")
        theirs = await register(flood, "victim")
        a_arena = SharedArena.attach(mine.arena_path, mine.arena_size, populate=False)
        b_arena = SharedArena.attach(theirs.arena_path, theirs.arena_size, populate=False)
        try:
            for batch in range(6):  # 48 chunks while the backend takes nothing
                await store(flood, b_arena, f"f{batch}", hashes(100 + batch, 8), FLOOD_FILL)
            assert await store(acme, a_arena, "k", hashes(7, 8), ACME_FILL) == 8
            gated.gate.set()
            await await_async(lambda: _drained(acme), what="the write-behind queue to drain")
            assert gated.fills.count(ACME_FILL) == 8  # all of A's chunks reached L2
            assert gated.fills.count(FLOOD_FILL) < 48  # (the flood's excess was skipped)
        finally:
            a_arena.close()
            b_arena.close()
        server.stop()


async def _drained(client: AsyncClient) -> bool:
    reply = await client.call(GetStats(), StatsReply)
    assert reply.cache is not None
    return reply.cache.write_behind_queued == 0 and reply.cache.l1_pins == 0
