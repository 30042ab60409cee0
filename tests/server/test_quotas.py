"""Quotas and store slots: the issue's L1 attacks against a real server (CURVE keys on tcp for
per-key shares, the shared arena mapped as a worker maps it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtrio.client import AsyncClient, open_client
from kvtrio.config import ServerConfig
from kvtrio.errors import QuotaExceeded
from kvtrio.protocol import (
    Commit,
    CommitReply,
    LayoutSpec,
    Lookup,
    LookupReply,
    Register,
    Registered,
    Store,
    StoreReply,
)
from kvtrio.server import open_server
from kvtrio.server.cache._quotas import scrub
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


async def register(client: AsyncClient, tenant: str = "") -> Registered:
    reply = await client.call(
        Register("w", "m", 1, 0, LAYOUT, "tokens/sha256-128/v1", tenant=tenant), Registered
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
        await scrub(arena, entries)
        assert not np.any(arena.view(0, 8 << 20))
        assert np.all(arena.view(8 << 20, 8 << 20) == 7)
    finally:
        arena.close()
