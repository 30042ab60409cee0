"""Quotas and store slots: the issue's L1 attacks against a real server (CURVE keys on tcp for
per-key shares, the shared arena mapped as a worker maps it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtrio.client import AsyncClient, open_client
from kvtrio.config import ServerConfig
from kvtrio.errors import BadRequest, QuotaExceeded, RequestError
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    CacheStats,
    Commit,
    CommitReply,
    FreeLookupLocks,
    GetStats,
    LayoutSpec,
    Lookup,
    LookupReply,
    Register,
    Registered,
    Release,
    Released,
    Retrieve,
    RetrieveReply,
    StatsReply,
    Store,
    StoreReply,
)
from kvtrio.server import open_server
from kvtrio.server.cache._quotas import Quotas
from kvtrio.server.cache._scrub import Scrubber
from kvtrio.shm import SharedArena
from kvtrio.storage import Entry, EntryState
from kvtrio.storage.keys import token_chunk_hashes

from .._support.tenants import tcp_config, tenant_clients

CHUNK = 256
LAYOUT = LayoutSpec("flash_attn", 2, 64, 16, 2, 16, "float16")
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 16 * 2  # 32 KiB
L1 = 512 * CHUNK_BYTES  # 16 MiB: 512 chunks


def hashes(tokens: tuple[int, ...]) -> tuple[bytes, ...]:
    return tuple(token_chunk_hashes(tokens, CHUNK))


def prompt(seed: int, chunks: int) -> tuple[int, ...]:
    return tuple(range(seed * 1_000_000, seed * 1_000_000 + chunks * CHUNK))


async def register(client: AsyncClient, tenant: str = "", engine: str = "w") -> Registered:
    reply = await client.call(
        Register(engine, "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS, tenant=tenant), Registered
    )
    assert reply.chunk_bytes == CHUNK_BYTES
    return reply


async def test_num_readers_is_capped_at_the_world_size(endpoint: str) -> None:
    config = ServerConfig(endpoint=endpoint, l1_size=L1, l2=())
    async with open_server(config) as server, open_client(server.endpoint) as client:
        await register(client)
        tokens = prompt(1, 2)
        await client.call(Store("a", 0, len(tokens), chunk_hashes=hashes(tokens)), StoreReply)
        await client.call(Commit("a", written=hashes(tokens)), CommitReply)
        found = await client.call(
            Lookup("b", "m", 1, chunk_hashes=hashes(tokens), engine="w", num_readers=1), LookupReply
        )
        assert found.hit_chunks == 2
        with pytest.raises(QuotaExceeded, match="num_readers 2"):
            await client.request(
                Lookup("c", "m", 1, chunk_hashes=hashes(tokens), engine="w", num_readers=2)
            )


async def _cache(client: AsyncClient) -> CacheStats:
    reply = await client.call(GetStats(), StatsReply)
    assert reply.cache is not None
    return reply.cache


async def test_a_negative_reader_count_cannot_take_another_engines_pin(endpoint: str) -> None:
    """Issue 32 item 1 (and item 9's negative ``l1_pins``), as reproduced: engine V retrieves
    X; engine H of the same tenant looks X up with ``num_readers=-3``, frees its lookup locks
    and stores more than L1 holds. Was: a hit, ``l1_pins`` at -3, V's slot refilled with H's
    bytes while V read it, V's release ``internal``. Now: refused, V's pin and bytes intact."""
    config = ServerConfig(endpoint=endpoint, l1_size=L1, l2=())
    async with (
        open_server(config) as server,
        open_client(server.endpoint) as v,
        open_client(server.endpoint) as h,
    ):
        registered = await register(v, engine="v")
        await register(h, engine="h")
        arena = SharedArena.attach(registered.arena_path, registered.arena_size, populate=False)
        try:
            x = hashes(prompt(7, 4))
            reply = await v.call(Store("x", 0, 4 * CHUNK, chunk_hashes=x), StoreReply)
            for slot in reply.slots:
                arena.view(slot.offset, slot.nbytes).fill(0xCD)
            await v.call(Commit("x", written=x), CommitReply)
            found = await v.call(Lookup("rv", "m", 1, x, engine="v"), LookupReply)
            assert found.hit_chunks == 4
            read = await v.call(Retrieve("rv", 0, 4 * CHUNK, chunk_hashes=x), RetrieveReply)
            assert [slot.status for slot in read.slots] == ["read"] * 4
            pins = (await _cache(v)).l1_pins
            assert pins == 4

            with pytest.raises(BadRequest, match=r"num_readers must be an integer in 0…256"):
                await h.request(Lookup("rh", "m", 1, x, num_readers=-3, engine="h"))
            assert (await _cache(h)).l1_pins == pins
            await h.request(FreeLookupLocks("rh", "m", engine="h"))
            for seed in range(20):  # more than L1 holds: whatever is not pinned is evicted
                other = hashes(prompt(300 + seed, 32))
                await h.call(Store(f"h{seed}", 0, 32 * CHUNK, chunk_hashes=other), StoreReply)
                await h.call(Commit(f"h{seed}", written=other), CommitReply)
                assert (await _cache(h)).l1_pins >= pins
            for slot in read.slots:
                assert np.all(arena.view(slot.offset, slot.nbytes) == 0xCD)
            released = await v.call(Release("rv", x), Released)
            assert released.released == 4
            assert (await _cache(v)).l1_pins == 0
        finally:
            arena.close()


def test_the_reader_quota_refuses_negative_counts() -> None:
    """Defense behind the codec's bound: a count below 0 never reaches a pin."""
    quotas = Quotas.__new__(Quotas)
    quotas.refused = 0
    with pytest.raises(RequestError, match=r"num_readers must be in 0…4 .*got -3") as info:
        quotas.readers(-3, 4)
    assert info.value.code.value == "bad_request"
    quotas.readers(0, 4)
    quotas.readers(4, 4)


async def test_reservation_flooding_by_one_key_leaves_room_for_another(short_dir: Path) -> None:
    config = tcp_config(l1_size=2 * L1, l1_tenants=2)  # an arena of L1 per tenant
    async with tenant_clients(short_dir, config) as (_server, attacker, victim):
        await register(attacker, "acme")
        await register(victim, "victim")
        tokens = prompt(2, 512)
        with pytest.raises(QuotaExceeded, match="of L1"):  # all of L1 at once
            await attacker.request(Store("flood", 0, len(tokens), chunk_hashes=hashes(tokens)))
        held = 0
        for seed in range(10, 30):  # then as much as it can, never committing
            tokens = prompt(seed, 32)
            try:
                reply = await attacker.call(
                    Store(f"f{seed}", 0, len(tokens), chunk_hashes=hashes(tokens)), StoreReply
                )
            except QuotaExceeded:
                break
            held += sum(slot.status == "write" for slot in reply.slots)
        assert 0 < held * CHUNK_BYTES <= 0.5 * L1
        tokens = prompt(3, 8)
        reply = await victim.call(
            Store("v", 0, len(tokens), chunk_hashes=hashes(tokens)), StoreReply
        )
        assert [slot.status for slot in reply.slots] == ["write"] * 8


async def test_pins_cannot_take_the_whole_of_l1(endpoint: str) -> None:
    config = ServerConfig(endpoint=endpoint, l1_size=L1, l2=(), lease_share=0.25)
    async with open_server(config) as server, open_client(server.endpoint) as client:
        await register(client)
        tokens = prompt(4, 200)  # 200 chunks: more than a quarter of L1
        await client.call(Store("big", 0, len(tokens), chunk_hashes=hashes(tokens)), StoreReply)
        await client.request(Commit("big", written=hashes(tokens)))
        with pytest.raises(QuotaExceeded, match="25% of L1"):
            await client.request(Lookup("pin-all", "m", 1, chunk_hashes=hashes(tokens), engine="w"))
        found = await client.call(
            Lookup("some", "m", 1, chunk_hashes=hashes(tokens[: 100 * CHUNK]), engine="w"),
            LookupReply,
        )
        assert found.hit_chunks == 100


async def test_a_store_slot_never_shows_a_previous_chunks_bytes(endpoint: str) -> None:
    config = ServerConfig(endpoint=endpoint, l1_size=L1, l2=())
    async with open_server(config) as server, open_client(server.endpoint) as client:
        registered = await register(client)
        arena = SharedArena.attach(registered.arena_path, registered.arena_size, populate=False)
        try:
            for seed in range(6):  # fill L1 (and more) with committed, secret bytes
                tokens = prompt(100 + seed, 128)
                reply = await client.call(
                    Store(f"s{seed}", 0, len(tokens), chunk_hashes=hashes(tokens)), StoreReply
                )
                for slot in reply.slots:
                    arena.view(slot.offset, slot.nbytes).fill(0xAB)
                await client.request(Commit(f"s{seed}", written=hashes(tokens)))
            # A new store evicts some of them and hands their slots out; unwritten, committed:
            tokens = prompt(200, 8)
            reply = await client.call(
                Store("x", 0, len(tokens), chunk_hashes=hashes(tokens)), StoreReply
            )
            assert [slot.status for slot in reply.slots] == ["write"] * 8
            for slot in reply.slots:
                assert not np.any(arena.view(slot.offset, slot.nbytes))
            await client.request(Commit("x", written=hashes(tokens)))
        finally:
            arena.close()


async def test_large_stores_are_zeroed_in_a_thread(tmp_path: Path) -> None:
    arena = SharedArena.create(16 << 20, directory=str(tmp_path))
    try:
        arena.view(0, 16 << 20).fill(7)
        entries = [Entry(b"k", i * (2 << 20), 2 << 20, EntryState.WRITING) for i in range(4)]
        await Scrubber(arena).in_thread(entries)
        assert not np.any(arena.view(0, 8 << 20))
        assert np.all(arena.view(8 << 20, 8 << 20) == 7)
    finally:
        arena.close()
