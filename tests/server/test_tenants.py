"""Per-tenant L1 arenas: the issue's shared-L1 attack, against a real server over real CURVE
(tcp on loopback), with the arenas mapped as a CPU worker maps them."""

from __future__ import annotations

import grp
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtrio.client import Client, open_client
from kvtrio.config import BackendSpec, ServerConfig
from kvtrio.errors import ErrorCode, QuotaExceeded, RequestError
from kvtrio.launch import ServerProcess
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    EndSession,
    GetStats,
    Lookup,
    LookupReply,
    Register,
    Registered,
    Release,
    Released,
    Retrieve,
    RetrieveReply,
    StatsReply,
    Unregister,
)
from kvtrio.server import open_server
from kvtrio.server._tenants import TenantArenas
from kvtrio.shm import SharedArena
from kvtrio.storage import Entry, L1Cache, Reservation

from .._support.tenants import (
    ARENA_CHUNKS,
    CHUNK,
    CHUNK_BYTES,
    LAYOUT,
    hashes,
    register,
    store,
    tcp_config,
    tenant_clients,
)
from .._support.waiting import await_async


async def test_a_tenant_cannot_read_write_or_evict_another_tenants_l1(short_dir: Path) -> None:
    config = tcp_config(l1_size=2 * ARENA_CHUNKS * CHUNK_BYTES, l1_tenants=2)
    # Tenant A (the victim: key acme, tenant acme), tenant B (the attacker: key and tenant victim).
    async with tenant_clients(short_dir, config) as (_server, tenant_a, tenant_b):
        mine = await register(tenant_a, "acme")
        theirs = await register(tenant_b, "victim")
        # Registration replies only ever name the caller's own arena.
        assert theirs.arena_path != mine.arena_path
        a_arena = SharedArena.attach(mine.arena_path, mine.arena_size, populate=False)
        b_arena = SharedArena.attach(theirs.arena_path, theirs.arena_size, populate=False)
        try:
            secret = hashes(1, 8)
            assert await store(tenant_a, a_arena, "v", secret, 0xA5) == 8
            # The attacker's whole mapping holds none of the victim's bytes...
            assert not (b_arena.buffer == 0xA5).any()
            # ...and asking for the victim's chunks by hash gets no hit and no slot.
            found = await tenant_b.call(
                Lookup("a", "m", 1, chunk_hashes=secret, tenant="victim", engine="w"), LookupReply
            )
            assert found.hit_chunks == 0
            got = await tenant_b.call(
                Retrieve("a", 0, 8 * CHUNK, chunk_hashes=secret), RetrieveReply
            )
            assert all(slot.status == "failed" for slot in got.slots)
            # Flooding its own arena (twice over) evicts only the attacker's own chunks.
            stored = 0
            for batch in range(8):
                flood = hashes(100 + batch, ARENA_CHUNKS // 4)
                stored += await store(tenant_b, b_arena, f"f{batch}", flood, 0x5A)
            assert stored == 2 * ARENA_CHUNKS
            assert not (a_arena.buffer == 0x5A).any()
            found = await tenant_a.call(
                Lookup("v2", "m", 1, chunk_hashes=secret, tenant="acme", engine="w"), LookupReply
            )
            assert found.hit_chunks == 8
            got = await tenant_a.call(
                Retrieve("v2", 0, 8 * CHUNK, chunk_hashes=secret), RetrieveReply
            )
            for slot in got.slots:
                assert slot.status == "read"
                assert (a_arena.view(slot.offset, slot.nbytes) == 0xA5).all()
            await tenant_a.call(Release("v2", chunk_hashes=secret), Released)
            stats = (await tenant_a.call(GetStats(), StatsReply)).cache
            assert stats is not None
            assert stats.l1_capacity_bytes == 2 * ARENA_CHUNKS * CHUNK_BYTES  # summed
            assert stats.l1_entries == 8 + ARENA_CHUNKS
        finally:
            a_arena.close()
            b_arena.close()


async def test_l2_loads_land_in_their_own_tenants_arena(short_dir: Path) -> None:
    config = tcp_config(
        l1_size=2 * ARENA_CHUNKS * CHUNK_BYTES,
        l1_tenants=2,
        l2=(BackendSpec("disk", {"path": str(short_dir / "l2")}),),
        retrieve_timeout=5.0,
    )
    async with tenant_clients(short_dir, config) as (_server, tenant_a, tenant_b):
        mine = await register(tenant_a, "acme")
        theirs = await register(tenant_b, "victim")  # the second arena (virtual base 1 << 44)
        a_arena = SharedArena.attach(mine.arena_path, mine.arena_size, populate=False)
        b_arena = SharedArena.attach(theirs.arena_path, theirs.arena_size, populate=False)
        try:
            kept = hashes(7, 8)
            assert await store(tenant_b, b_arena, "k", kept, 0x3C) == 8

            async def written() -> bool:
                reply = await tenant_b.call(GetStats(), StatsReply)
                return reply.l2[0].counters.get("stores", 0) >= 8

            await await_async(written, what="8 chunks written to L2")
            for batch in range(8):  # evict them from L1 (B's own arena, twice over)
                await store(tenant_b, b_arena, f"f{batch}", hashes(200 + batch, 8), 0x11)
            found = await tenant_b.call(
                Lookup("k2", "m", 1, chunk_hashes=kept, tenant="victim", engine="w"), LookupReply
            )
            assert found.hit_chunks == 8
            got = await tenant_b.call(
                Retrieve("k2", 0, 8 * CHUNK, chunk_hashes=kept), RetrieveReply
            )
            for slot in got.slots:
                assert slot.status == "read"
                assert (b_arena.view(slot.offset, slot.nbytes) == 0x3C).all()
            await tenant_b.call(Release("k2", chunk_hashes=kept), Released)
            stats = (await tenant_b.call(GetStats(), StatsReply)).cache
            assert stats is not None
            assert stats.lookup_l2_chunks > 0  # some did come back from L2
            assert not (a_arena.buffer == 0x3C).any()
        finally:
            a_arena.close()
            b_arena.close()


async def test_more_tenants_than_arenas_are_refused(short_dir: Path) -> None:
    config = tcp_config(l1_size=ARENA_CHUNKS * CHUNK_BYTES)  # --l1-tenants 1 (the default)
    async with tenant_clients(short_dir, config) as (_server, first, second):
        await register(first, "acme")
        await register(first, "acme")  # its own arena again
        with pytest.raises(QuotaExceeded, match="--l1-tenants"):
            await second.request(
                Register("w", "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS, tenant="victim")
            )


async def test_tenant_arenas_are_private_and_removed_with_the_server(short_dir: Path) -> None:
    shm = short_dir / "shm"
    shm.mkdir()
    group = grp.getgrgid(os.getgid()).gr_name
    config = tcp_config(
        l1_size=2 * ARENA_CHUNKS * CHUNK_BYTES, l1_tenants=2, shm_dir=str(shm), ipc_group=group
    )
    async with tenant_clients(short_dir, config) as (_server, one, two):
        paths = [(await register(c, t)).arena_path for c, t in ((one, "acme"), (two, "victim"))]
        for path in paths:
            info = os.stat(path)
            assert stat.S_IMODE(info.st_mode) == 0o660
            assert info.st_gid == os.getgid()
        assert len({os.path.basename(p) for p in paths}) == 2
        # The arena created at the second tenant's registration has its pages before the reply.
        assert os.stat(paths[1]).st_blocks * 512 >= ARENA_CHUNKS * CHUNK_BYTES
    assert not list(shm.iterdir())


async def test_one_tenant_keeps_one_arena_of_the_whole_l1(endpoint: str) -> None:
    config = ServerConfig(endpoint=endpoint, l1_size=ARENA_CHUNKS * CHUNK_BYTES, l2=())
    async with open_server(config) as server, open_client(server.endpoint) as client:
        reply = await register(client, "")
        assert reply.arena_size == ARENA_CHUNKS * CHUNK_BYTES
        assert stat.S_IMODE(os.stat(reply.arena_path).st_mode) == 0o600


def test_tenant_index_routes_by_namespace_and_offset(tmp_path: Path) -> None:
    first = SharedArena.create(8 * CHUNK_BYTES, directory=str(tmp_path))
    arenas = TenantArenas(
        first, lambda size, base: L1Cache(size, base=base), limit=2, directory=str(tmp_path)
    )
    try:
        a, b = arenas.for_tenant("a"), arenas.for_tenant("b")
        arenas.bind(b"A" * 16, a)
        arenas.bind(b"B" * 16, b)
        l1, memory = arenas.l1, arenas.memory
        # A key of no bound namespace is in no arena: never found, never reserved.
        assert l1.reserve(b"C" * 32, CHUNK_BYTES) is Reservation.NO_SPACE
        assert l1.get(b"C" * 32) is None
        entry_a = l1.reserve(b"A" * 32, CHUNK_BYTES)
        entry_b = l1.reserve(b"B" * 32, CHUNK_BYTES)
        assert isinstance(entry_a, Entry)
        assert isinstance(entry_b, Entry)
        assert (a.local(entry_a.offset), b.local(entry_b.offset)) == (0, 0)
        assert entry_b.offset == 1 << 44
        memory.view(entry_b.offset, CHUNK_BYTES).fill(9)
        assert (b.arena.view(0, CHUNK_BYTES) == 9).all()
        assert not a.arena.buffer.any()
        stats = l1.stats()
        assert (stats.capacity_bytes, stats.writing) == (16 * CHUNK_BYTES, 2)
        with pytest.raises(RequestError, match="--l1-tenants") as refused:
            arenas.for_tenant("c")
        assert refused.value.code is ErrorCode.QUOTA_EXCEEDED
    finally:
        arenas.close()
    assert not list(tmp_path.iterdir())


def test_a_killed_servers_tenant_arenas_are_reclaimed_at_the_next_start(
    server_process: Callable[..., ServerProcess], short_dir: Path
) -> None:
    shm = short_dir / "shm"
    shm.mkdir()
    server = server_process("--shm-dir", str(shm), "--l1-tenants", "2")
    with (
        Client(server.endpoint, timeout=5.0, heartbeat=False) as one,
        Client(server.endpoint, timeout=5.0, heartbeat=False) as two,
    ):  # ipc peers may use any tenant
        for client, tenant in ((one, "a"), (two, "b")):
            reply = client.request(
                Register("w", "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS, tenant=tenant)
            )
            assert isinstance(reply, Registered)
        assert len(list(shm.iterdir())) == 2
    server.kill()
    assert len(list(shm.iterdir())) == 2  # nobody removed them
    server.start()  # its own first arena reclaims both leftovers
    assert len(list(shm.iterdir())) == 1


# --------------------------------------------------------------------------- issue 32


def _lookup(request: str, chunk_hashes: tuple[bytes, ...], tenant: str) -> Lookup:
    return Lookup(request, "m", 1, chunk_hashes=chunk_hashes, tenant=tenant, engine="w")


async def test_an_idle_tenants_arena_is_renewed_for_another_with_none_of_its_bytes(
    short_dir: Path,
) -> None:
    """Was: the one arena (``--l1-tenants 1``) stayed acme's for the server's life, so the
    victim tenant's registration got ``quota_exceeded`` once acme had registered once."""
    config = tcp_config(l1_size=ARENA_CHUNKS * CHUNK_BYTES)  # --l1-tenants 1
    async with tenant_clients(short_dir, config) as (server, acme, victim):
        mine = await register(acme, "acme")
        old = SharedArena.attach(mine.arena_path, mine.arena_size, populate=False)
        try:
            secret = hashes(3, ARENA_CHUNKS // 2)
            assert await store(acme, old, "s", secret, 0xA5) == len(secret)
            # While acme's chunks are pinned (a lookup holds them), its arena is in use.
            assert (await acme.call(_lookup("p", secret, "acme"), LookupReply)).hit_chunks > 0
            await acme.call(Unregister(), Released)  # (its session's leases go with it)
            assert (await acme.call(_lookup("p", secret, "acme"), LookupReply)).hit_chunks == 0
            theirs = await register(victim, "victim")
            assert theirs.arena_path != mine.arena_path
            # Unlinked: nobody can open it again.
            assert not Path(mine.arena_path).exists()  # noqa: ASYNC240
            new = SharedArena.attach(theirs.arena_path, theirs.arena_size, populate=False)
            try:
                assert not new.buffer.any()  # a fresh file: not a byte of acme's
                # acme's worker still maps the old file: what it writes there stays there.
                old.buffer.fill(0x77)
                assert not (new.buffer == 0x77).any()
                assert await store(victim, new, "v", hashes(4, 8), 0x3C) == 8
                assert not (old.buffer == 0x3C).any()
                # acme comes back: the arena is the victim's now (registered), so it waits.
                with pytest.raises(QuotaExceeded, match="--l1-tenants"):
                    await acme.request(
                        Register("w", "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS, tenant="acme")
                    )
            finally:
                new.close()
        finally:
            old.close()
        assert server.state.cache.core.arenas.renewed == 1


async def test_an_arena_with_pins_or_a_registration_is_not_renewed(short_dir: Path) -> None:
    config = tcp_config(l1_size=ARENA_CHUNKS * CHUNK_BYTES)  # --l1-tenants 1
    keys = short_dir / "tenants"
    async with tenant_clients(short_dir, config) as (server, acme, victim):
        mine = await register(acme, "acme")
        arena = SharedArena.attach(mine.arena_path, mine.arena_size, populate=False)
        try:
            secret = hashes(5, 4)
            assert await store(acme, arena, "s", secret, 0x11) == 4
        finally:
            arena.close()
        refused = Register("w", "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS, tenant="victim")
        with pytest.raises(QuotaExceeded, match="--l1-tenants"):  # acme is registered
            await victim.request(refused)
        # acme's scheduler (another session of its key) pins the chunks; the worker leaves.
        async with open_client(
            server.endpoint,
            server_key=str(keys / "server.key"),
            client_key=str(keys / "acme.key_secret"),
        ) as scheduler:
            assert (await scheduler.call(_lookup("p", secret, "acme"), LookupReply)).hit_chunks
            await acme.call(Unregister(), Released)
            with pytest.raises(QuotaExceeded, match="--l1-tenants"):  # pinned
                await victim.request(refused)
            await scheduler.call(EndSession("p", "m", tenant="acme", engine="w"), Released)
            assert isinstance(await victim.call(refused, Registered), Registered)
        assert server.state.cache.core.arenas.renewed == 1


async def test_a_key_for_two_tenants_gives_back_the_arena_of_the_one_it_left(
    endpoint: str,
) -> None:
    """Was (issue 32, item 9): a key for two tenants on an ``--l1-tenants 2`` server kept both
    arenas for the server's life: a third tenant was refused after the first had left."""
    config = ServerConfig(endpoint=endpoint, l1_size=2 * ARENA_CHUNKS * CHUNK_BYTES, l2=(),
                          l1_tenants=2)  # fmt: skip
    async with (
        open_server(config) as server,
        open_client(server.endpoint) as one,
        open_client(server.endpoint) as two,
    ):  # ipc peers may use any tenant
        first = await register(one, "a")
        await register(two, "b")
        with pytest.raises(QuotaExceeded, match="--l1-tenants"):
            await one.request(Register("w", "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS, tenant="c"))
        await one.call(Unregister(), Released)
        third = await register(one, "c")  # a's arena, renewed
        assert third.arena_path != first.arena_path
        assert len(server.state.cache.core.arenas.all) == 2
        await two.call(Unregister(), Released)
        again = await register(two, "a")  # b's, renewed for a (back again)
        assert again.arena_path not in (first.arena_path, third.arena_path)
        assert server.state.cache.core.arenas.renewed == 2


async def test_a_renewed_arena_keeps_no_index_offsets_or_names_of_the_old_tenant(
    tmp_path: Path,
) -> None:
    removed: list[bytes] = []

    class Listener:
        def ready(self, key: bytes, parent: bytes | None) -> None:
            pass

        def removed(self, key: bytes) -> None:
            removed.append(key)

    def make_l1(size: int, base: int) -> L1Cache:
        l1 = L1Cache(size, base=base)
        l1.listener = Listener()
        return l1

    first = SharedArena.create(8 * CHUNK_BYTES, directory=str(tmp_path))
    arenas = TenantArenas(first, make_l1, limit=1, directory=str(tmp_path))
    try:
        async with arenas.opened("a") as a:
            arenas.bind(b"A" * 16, a)
        keys = [b"A" * 16 + bytes([i]) * 16 for i in range(5)]
        for key in keys:
            entry = arenas.l1.reserve(key, CHUNK_BYTES)
            assert isinstance(entry, Entry)
            arenas.memory.view(entry.offset, CHUNK_BYTES).fill(0xA5)
            arenas.l1.commit(key)
        old_offset = entry.offset
        arenas.l1.pin(keys[0])
        with pytest.raises(RequestError, match="all in use"):  # (no idle tenant)
            arenas.for_tenant("b", lambda _: False)
        arenas.l1.unpin(keys[0])
        async with arenas.opened("b", lambda arena: arena.tenant == "a") as b:
            assert b.index == 1
            assert b.arena.path != a.arena.path
            assert not b.arena.buffer.any()
        assert sorted(removed) == keys  # KV events hear that a's chunks are gone
        assert arenas.l1.get(keys[1]) is None  # a's namespace is bound to no arena now
        with pytest.raises(ValueError, match="in no arena"):
            arenas.of_offset(old_offset)  # an old offset names no arena, never b's bytes
        assert arenas.tenant_count() == 1
        assert len(os.listdir(tmp_path)) == 1  # a's file is gone
    finally:
        arenas.close()
    assert not os.listdir(tmp_path)
