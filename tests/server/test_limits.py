"""Issue 11: what clients can make the server hold is bounded (shapes, requests, pins)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from kvtrio.client import open_client
from kvtrio.config import ServerConfig
from kvtrio.errors import BadRequest, RequestError, ServerBusy
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    MAX_HASHES,
    MAX_LOOKUP_KEYS,
    Commit,
    EndSession,
    LayoutSpec,
    Lookup,
    LookupBatch,
    LookupReply,
    Register,
    Release,
    Released,
    Request,
    Retrieve,
    Store,
)
from kvtrio.server import open_server
from kvtrio.server.cache._limits import RequestLimits, key_group, tenant_group
from kvtrio.shm import SharedArena
from kvtrio.storage import Lease, LeaseKind, LeaseTable
from kvtrio.testing import FaultBackend

from .._support.l2_tier import CHUNK, HASHES, LAYOUT, cache, lookup, running, store
from .._support.tenants import ARENA_CHUNKS, CHUNK_BYTES, hashes, tcp_config, tenant_clients
from .._support.tenants import register as register_tenant
from .._support.tenants import store as tenant_store
from .._support.waiting import await_condition


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"num_blocks": 2**62},
            "num_blocks must be an integer in 1…4294967296, got 4611686018427387904",
        ),
        ({"num_heads": 2**40}, "num_heads must be an integer in 1…65536"),
        ({"num_layers": 0}, "num_layers must be an integer in 1…4096, got 0"),
        ({"head_dim": 4096, "num_layers": 4096}, "more than the whole L1 arena"),
    ],
)
async def test_an_impossible_registration_is_a_one_line_bad_request(
    server_config: ServerConfig, changes: dict[str, int], message: str
) -> None:
    """Was: 2^62 blocks accepted; 2^40 heads an `internal` error with a traceback."""
    layout: LayoutSpec = attrs.evolve(LAYOUT, **changes)
    async with open_server(server_config) as server, open_client(server.endpoint) as client:
        with pytest.raises(BadRequest) as info:
            await client.request(Register("w", "m", 1, 0, layout, HASH_SCHEME_TOKENS))
        assert message in str(info.value)
        assert "\n" not in str(info.value)
        with pytest.raises(BadRequest, match="world_size must be an integer in 1…256 "):
            await client.request(Register("w", "m", 2**20, 0, LAYOUT, HASH_SCHEME_TOKENS))
        odd = attrs.evolve(LAYOUT, block_size=48)  # (still the registry's own message)
        with pytest.raises(BadRequest, match="block size 48 does not divide"):
            await client.request(Register("w", "m", 1, 0, odd, HASH_SCHEME_TOKENS))
        server.stop()


async def test_requests_holding_pins_are_bounded_and_idle_ones_cost_nothing(
    server_config: ServerConfig,
) -> None:
    config = attrs.evolve(server_config, max_requests=3)
    async with running(config, MemoryBackend()) as (_, worker, scheduler):
        await store(worker, "a", 2)  # committed: "a" holds nothing, so it does not count
        for request in ("r1", "r2"):  # two lookups hit: they hold pins
            assert await lookup(scheduler, request, 2) == LookupReply(2 * CHUNK, 2)
        assert await lookup(scheduler, "r3", 2) == LookupReply(2 * CHUNK, 2)
        assert (await cache(worker)).requests == 3
        with pytest.raises(ServerBusy, match="max_requests"):
            await lookup(scheduler, "r4", 2)
        await scheduler.request(EndSession("r1", "m"))
        assert await lookup(scheduler, "r4", 2) == LookupReply(2 * CHUNK, 2)
        assert (await cache(worker)).requests == 3


async def test_pins_are_bounded(server_config: ServerConfig) -> None:
    config = attrs.evolve(server_config, max_pins=5)
    async with running(config, MemoryBackend()) as (_, worker, scheduler):
        await store(worker, "a", 4)
        assert await lookup(scheduler, "r1", 4) == LookupReply(4 * CHUNK, 4)
        with pytest.raises(ServerBusy, match="max_pins"):
            await lookup(scheduler, "r2", 4)
        await scheduler.request(EndSession("r1", "m"))
        assert await lookup(scheduler, "r2", 4) == LookupReply(4 * CHUNK, 4)


# --------------------------------------------------------------------------- issue 32


async def test_one_tenants_flood_of_lookups_leaves_another_tenant_served(
    short_dir: Path,
) -> None:
    """Was: one global count: tenant victim's held lookups took all of ``max_requests`` and
    tenant acme got ``busy`` until they ended (11 s after the socket vanished)."""
    config = tcp_config(l1_size=2 * ARENA_CHUNKS * CHUNK_BYTES, l1_tenants=2, max_requests=8)
    async with tenant_clients(short_dir, config) as (server, acme, victim):
        chunks = hashes(1, 1)
        for client, tenant in ((acme, "acme"), (victim, "victim")):
            reply = await register_tenant(client, tenant)
            arena = SharedArena.attach(reply.arena_path, reply.arena_size, populate=False)
            try:
                assert await tenant_store(client, arena, "s", chunks, 1) == 1
            finally:
                arena.close()

        def one_chunk(request: str, tenant: str) -> Lookup:
            return Lookup(request, "m", 1, chunk_hashes=chunks, tenant=tenant, engine="w")

        for n in range(2):  # 8 / 2 tenants, half of that for its one key (lease_share_per_key)
            assert (await victim.call(one_chunk(f"f{n}", "victim"), LookupReply)).hit_chunks
        for n in range(2, 8):  # the flood ends at its share
            with pytest.raises(ServerBusy, match="share of"):
                await victim.call(one_chunk(f"f{n}", "victim"), LookupReply)
        for n in range(2):  # acme's own share is whole
            assert (await acme.call(one_chunk(f"a{n}", "acme"), LookupReply)).hit_chunks == 1
        assert _core(server).leases.requests == 4
        with pytest.raises(ServerBusy, match="share of"):
            await acme.call(one_chunk("a2", "acme"), LookupReply)
        await acme.call(EndSession("a0", "m", tenant="acme", engine="w"), Released)
        assert (await acme.call(one_chunk("a2", "acme"), LookupReply)).hit_chunks == 1


def test_requests_are_counted_per_tenant_and_per_key_and_freed_with_their_leases() -> None:
    owners = {"s1": "k1", "s2": "k2", "s3": "k3"}  # session → client key
    tenants = {b"A": "a", b"B": "b"}  # a key's first byte → its tenant

    def groups(lease: Lease) -> tuple[str, ...]:
        tenant = tenants[lease.key[:1]]
        return tenant_group(tenant), key_group(tenant, owners[lease.owner])

    leases = LeaseTable(groups)
    limits = RequestLimits(max_requests=12, max_pins=100, tenants=2, share_per_key=0.5)
    assert (limits.per_tenant, limits.per_key) == (6, 3)

    def take(request: str, session: str, key: bytes) -> None:
        limits.admit_request(leases, request, tenants[key[:1]], owners[session])
        leases.add(LeaseKind.LOOKUP, request, session, key, 1, 60.0)

    for n in range(3):  # k1 takes its share of tenant a...
        take(f"r{n}", "s1", b"A%d" % n)
    with pytest.raises(RequestError, match="client key's share"):
        take("r3", "s1", b"A3")
    take("r0", "s1", b"A9")  # (a request it holds already is not a new one)
    for n in range(3):  # ...and k2, of the same tenant, still gets its own
        take(f"q{n}", "s2", b"A%d" % n)
    with pytest.raises(RequestError, match="tenant's share"):
        take("q3", "s3", b"A3")
    for n in range(6):  # tenant b is untouched by tenant a's six (k2's share there is whole)
        take(f"b{n}", "s3" if n < 3 else "s2", b"B%d" % n)
    with pytest.raises(RequestError, match=r"12 at most: max_requests\)"):  # all 12 taken
        take("b6", "s1", b"B6")
    assert len(leases.pop_owner("s1")) == 4  # s1's session ends: its 3 requests are free again
    assert leases.requests_by_group[tenant_group("a")] == 3
    assert key_group("a", "k1") not in leases.requests_by_group
    take("r4", "s1", b"A4")
    assert leases.requests == 10


def test_a_tenants_pins_are_bounded_by_its_share_of_max_pins() -> None:
    leases = LeaseTable(lambda lease: (tenant_group(lease.key[:1].decode()),))
    limits = RequestLimits(max_requests=100, max_pins=8, tenants=2)
    limits.admit_pins(leases, 4, tenant="a")
    for n in range(4):
        leases.add(LeaseKind.LOOKUP, f"r{n}", "s", b"a%d" % n, 1, 60.0)
    with pytest.raises(RequestError, match="its share of max_pins"):
        limits.admit_pins(leases, 1, tenant="a")
    limits.admit_pins(leases, 4, tenant="b")  # tenant b's share is untouched
    leases.pop_request("r0")
    assert leases.leases_by_group[tenant_group("a")] == 3
    limits.admit_pins(leases, 1, tenant="a")


# --------------------------------------------------------------------------- issue 22


def _hashes(count: int, salt: int = 0) -> tuple[bytes, ...]:
    return tuple(salt.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(count))


def _core(server: Any) -> Any:
    return server.state.cache.core


async def test_a_world_size_beyond_the_limit_is_refused(server_config: ServerConfig) -> None:
    """Was: rank 0 of world 4096 registered, and each lookup then made 4096 × hashes keys and
    4096 L2 probe tasks (a 32 × 63 batch took 64 s of the loop)."""
    async with running(server_config, MemoryBackend()) as (_, worker, scheduler):
        with pytest.raises(
            BadRequest, match=r"world_size must be an integer in 1…256 .*, got 4096"
        ):
            await worker.request(Register("", "m", 4096, 0, LAYOUT, HASH_SCHEME_TOKENS))
        with pytest.raises(BadRequest, match=r"1…256 \(MAX_WORLD_SIZE\), got 4096"):
            await scheduler.request(Lookup("r", "m", 4096, HASHES[:1]))
        with pytest.raises(BadRequest, match="MAX_WORLD_SIZE"):
            await scheduler.request(LookupBatch("m", 4096, ("a",), (HASHES[:1],)))


async def test_a_lookup_of_more_keys_than_the_bound_is_refused_before_any_work(
    server_config: ServerConfig,
) -> None:
    """world × hashes, summed over a batch, is bounded (a batch's lookups were admitted one by
    one, each against live pins only)."""
    async with running(server_config, MemoryBackend()) as (server, _, scheduler):
        await scheduler.request(Register("", "w", 256, 0, LAYOUT, HASH_SCHEME_TOKENS))
        per = MAX_LOOKUP_KEYS // 256
        assert await scheduler.call(Lookup("ok", "w", 256, _hashes(per)), LookupReply)
        with pytest.raises(BadRequest, match=r"256 × 257 chunk hashes is 65792 keys.*MAX_LOOKUP"):
            await scheduler.request(Lookup("r", "w", 256, _hashes(per + 1)))
        batch = LookupBatch("w", 256, ("a", "b"), (_hashes(per // 2 + 1), _hashes(per // 2, 1)))
        with pytest.raises(BadRequest, match="MAX_LOOKUP_KEYS"):
            await scheduler.request(batch)
        assert _core(server).leases.live == 0  # nothing of the refused lookups was pinned


@pytest.mark.parametrize(
    "make",
    [
        lambda h: Commit("r", written=h),
        lambda h: Commit("r", failed=h),
        lambda h: Release("r", h),
        lambda h: Store("r", 0, len(h) * CHUNK, h),
        lambda h: Retrieve("r", 0, len(h) * CHUNK, h),
        lambda h: Lookup("r", "m", 1, h),
    ],
)
async def test_an_array_of_more_hashes_than_the_bound_is_refused_undecoded(
    server_config: ServerConfig, make: Callable[[tuple[bytes, ...]], Request]
) -> None:
    """Was: a commit of 900k hashes held the loop 3.4 s, a release 1.3 s, a lookup 1.4 s."""
    async with running(server_config, MemoryBackend()) as (_, worker, _scheduler):
        with pytest.raises(BadRequest, match=rf"at most {MAX_HASHES} chunk hashes.*MAX_HASHES"):
            await worker.request(make(_hashes(MAX_HASHES + 1)))
        await worker.request(make(_hashes(MAX_HASHES)))  # (the bound itself is legal)


async def test_lookups_still_in_their_l2_part_count_against_the_budgets(
    server_config: ServerConfig,
) -> None:
    """The keys of lookups whose L2 part runs count per session and against max_pins (they
    counted nowhere: admit_pins saw only live pins)."""
    config = attrs.evolve(server_config, max_pins=12, lookup_timeout=5.0)
    backend = FaultBackend(inner=MemoryBackend())
    async with running(config, backend) as (server, worker, scheduler):
        core = _core(server)
        core.budget.per_session = 10
        backend.configure(latency=30)  # the L2 part of a lookup waits (until lookup_timeout)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lookup, scheduler, "slow", 8)
            await await_condition(lambda: core.budget.total == 8, what="the L2 part to start")
            with pytest.raises(ServerBusy, match=r"8 keys are still running \(10 keys at most"):
                await lookup(scheduler, "more", 8)  # its session's budget
            with pytest.raises(ServerBusy, match=r"lookups under way may take 8 more.*max_pins"):
                await lookup(worker, "other", 8)  # another session: the server's pins
            backend.configure(latency=0)
            nursery.cancel_scope.cancel()
        await await_condition(lambda: core.budget.total == 0, what="the budget to be returned")
        assert await lookup(scheduler, "later", 8) == LookupReply(0, 0)


def test_the_key_budget_is_per_session_and_per_client_key() -> None:
    from kvtrio.server.cache._limits import KeyBudget

    budget = KeyBudget(per_session=10, per_user=15)
    budget.take("s1", "alice", 8)
    budget.take("s2", "alice", 7)
    with pytest.raises(
        RequestError, match=r"15 keys are still running \(15 keys at most per client key"
    ):
        budget.take("s3", "alice", 1)
    budget.take("s3", "", 10)  # no client key (ipc, --insecure): per session only
    with pytest.raises(RequestError, match="at most per session"):
        budget.take("s1", "bob", 3)
    for session, user, keys in (("s1", "alice", 8), ("s2", "alice", 7), ("s3", "", 10)):
        budget.give(session, user, keys)
    assert (budget.total, dict(budget.by_session), dict(budget.by_user)) == (0, {}, {})


# --------------------------------------------------------------------------- issue 32


async def test_megabyte_ids_and_model_names_are_refused_and_never_logged(
    server_config: ServerConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """Items 6 and 7: 1,200 lookups with 1 MiB request ids grew the server from 90 MB to
    1.3 GB; 800 registrations with 1 MiB model names wrote 1.6 GiB of log. Each is now one
    ``bad_request`` at decode, whose reply and log name the field and its bound, not the
    value."""
    huge = "x" * (1 << 20)
    with caplog.at_level(logging.DEBUG):
        async with running(server_config, MemoryBackend()) as (_, worker, scheduler):
            for _ in range(5):
                with pytest.raises(BadRequest, match="model must be at most 1024 char") as info:
                    await worker.request(Register("w", huge, 1, 0, LAYOUT, HASH_SCHEME_TOKENS))
                assert len(str(info.value)) < 200
                with pytest.raises(BadRequest, match="request must be at most 512 char"):
                    await scheduler.request(Lookup(huge, "m", 1, HASHES[:1]))
                with pytest.raises(BadRequest, match="engine must be at most 512 char"):
                    await scheduler.request(Lookup("r", "m", 1, HASHES[:1], engine=huge))
            assert await lookup(scheduler, "r", 1) == LookupReply(0, 0)  # (still serving)
    logged = sum(len(record.getMessage()) + len(str(record.__dict__)) for record in caplog.records)
    assert logged < 256 << 10, logged
