"""Issue 22, item 5: one unreadable object of the disk L2 costs that object, not the backend.

A real server (in the test's loop) over a real disk backend, two tenants. Between the servers
the disk backend is made anew over the same directory (a restart: the index comes from the
scan). The one injected fault is EIO under one record (``os.preadv`` of the backend's worker
threads over that range fails, see ``tests/l2/test_disk_unreadable.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio

from kvtrio.client import AsyncClient, open_client
from kvtrio.config import ServerConfig
from kvtrio.l2 import UnreadableObjects
from kvtrio.l2.disk import DiskBackend, DiskOptions
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    Commit,
    EndSession,
    GetStats,
    LayoutSpec,
    Lookup,
    LookupReply,
    Register,
    Release,
    Retrieve,
    RetrieveReply,
    StatsReply,
    Store,
    StoreReply,
)
from kvtrio.server import open_server
from kvtrio.server.l2tier import TierBackend
from kvtrio.storage import token_chunk_hashes

from .._support.disk_faults import BadRecords, fail_reads_of
from .._support.waiting import await_async

_SERVERS = itertools.count()
CHUNK = 256
LAYOUT = LayoutSpec("flash_attn", 2, 64, 16, 2, 16, "float16")  # 64 KiB chunks


def prompt(seed: int, chunks: int = 10) -> tuple[bytes, ...]:
    return tuple(token_chunk_hashes(range(seed, seed + chunks * CHUNK), CHUNK))


A = prompt(1_000_000)
B = [prompt(2_000_000 + 100_000 * i) for i in range(4)]


@attrs.define
class Clients:
    a: AsyncClient
    b: AsyncClient
    scheduler: AsyncClient
    backend: DiskBackend
    """The server's own (a second backend on its directory is refused: it is locked)."""


@asynccontextmanager
async def running(config: ServerConfig, path: Path) -> AsyncIterator[Clients]:
    """A server over a new disk backend on ``path``, workers of tenants a and b, a scheduler."""
    config = attrs.evolve(config, endpoint=f"{config.endpoint}.{next(_SERVERS)}")
    backend = DiskBackend(DiskOptions(path=str(path)))
    async with (
        open_server(config, backends=[("disk", backend)]) as server,
        open_client(server.endpoint) as a,
        open_client(server.endpoint) as b,
        open_client(server.endpoint) as scheduler,
    ):
        for client, tenant in ((a, "a"), (b, "b")):
            await client.request(
                Register("w", "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS, tenant=tenant)
            )
        yield Clients(a, b, scheduler, backend)
        server.stop()


async def counters(client: AsyncClient) -> dict[str, float]:
    return dict((await client.call(GetStats(), StatsReply)).l2[0].counters)


async def store(worker: AsyncClient, request: str, hashes: tuple[bytes, ...]) -> None:
    reply = await worker.call(Store(request, 0, len(hashes) * CHUNK, hashes), StoreReply)
    written = tuple(hashes[slot.chunk] for slot in reply.slots if slot.status == "write")
    await worker.request(Commit(request, written=written))


async def serve(
    clients: Clients, worker: AsyncClient, tenant: str, request: str, hashes: tuple[bytes, ...]
) -> int:
    """Look the prompt up and retrieve it, as an engine does; the chunks read."""
    found = await clients.scheduler.call(
        Lookup(request, "m", 1, hashes, tenant=tenant, engine="w"), LookupReply
    )
    got = found.hit_chunks
    reply = await worker.call(Retrieve(request, 0, got * CHUNK, hashes[:got]), RetrieveReply)
    read = tuple(hashes[slot.chunk] for slot in reply.slots if slot.status == "read")
    if read:
        await worker.request(Release(request, read))
    await clients.scheduler.request(EndSession(request, "m", tenant=tenant, engine="w"))
    return len(read)


@pytest.fixture
def config(server_config: ServerConfig) -> ServerConfig:
    return attrs.evolve(
        server_config, l1_tenants=2, lookup_timeout=2.0, retrieve_timeout=5.0, l1_size=16 << 20
    )


@pytest.fixture
def stored(config: ServerConfig, tmp_path: Path) -> Path:
    """The directory of a disk L2 holding A's prompt and B's four (written by one server)."""
    path = tmp_path / "l2"

    async def write() -> None:
        async with running(config, path) as clients:
            await store(clients.a, "a", A)
            for i, hashes in enumerate(B):
                await store(clients.b, f"b{i}", hashes)

            async def written() -> bool:
                return (await counters(clients.a)).get("stores", 0) >= 10 * (1 + len(B))

            await await_async(written, what="every chunk written to L2")

    trio.run(write)
    return path


def key_of(backend: DiskBackend, chunk_hash: bytes) -> bytes:
    (key,) = [key for key in backend._index if key.endswith(chunk_hash)]
    return key


async def test_one_unreadable_object_of_a_costs_that_object_not_bs_hits(
    config: ServerConfig, stored: Path, bad_records: BadRecords
) -> None:
    """Was: A's EIO backed the whole disk L2 off, B was served 0 of its 40 chunks, and A's
    object stayed for ever."""
    async with running(config, stored) as clients:
        backend = clients.backend  # (to find where A's first chunk is)
        fail_reads_of(backend, bad_records, key_of(backend, A[0]))

        assert await serve(clients, clients.a, "a", "a1", A) < 10  # its first chunk failed
        served = [await serve(clients, clients.b, "b", f"b{i}", B[i]) for i in range(len(B))]
        assert sum(served) == 40
        seen = await counters(clients.a)
        assert seen.get("read_errors", 0) == 1
        assert seen.get("unreadable", 0) == 0  # one failure: it may have been a passing one

        assert await serve(clients, clients.a, "a", "a2", A) < 10  # the second failure ...
        seen = await counters(clients.a)
        assert seen.get("read_errors", 0) == 2
        assert seen.get("unreadable", 0) == 1  # ... drops it
        assert seen["objects"] == 10 * (1 + len(B)) - 1
        found = await clients.scheduler.call(
            Lookup("a3", "m", 1, A, tenant="a", engine="w"), LookupReply
        )
        assert found.hit_chunks == 0  # a miss now (the engine recomputes and stores it again)
        await clients.scheduler.request(EndSession("a3", "m", tenant="a", engine="w"))
        assert (await clients.a.call(GetStats(), StatsReply)).l2[0].healthy is True
        # B's prompts were never in doubt.
        served = [await serve(clients, clients.b, "b", f"b{i}x", B[i]) for i in range(len(B))]
        assert sum(served) == 40


async def test_distinct_objects_failing_in_a_row_back_the_backend_off(
    config: ServerConfig, stored: Path, bad_records: BadRecords
) -> None:
    """When it is not one object (reads of several distinct objects fail, none succeeds), it is
    the disk: the backend is backed off as before, and no object is blamed."""
    async with running(config, stored) as clients:
        backend = clients.backend
        for hashes in B:
            for chunk_hash in hashes:
                fail_reads_of(backend, bad_records, key_of(backend, chunk_hash))
        for i in range(3):
            assert await serve(clients, clients.b, "b", f"b{i}", B[i]) == 0
        stats = (await clients.a.call(GetStats(), StatsReply)).l2[0]
        assert stats.healthy is False
        assert stats.counters.get("unreadable", 0) == 0  # nothing is blamed on the objects


def test_an_object_goes_at_its_second_failure_in_a_row_and_distinct_ones_are_the_backend() -> None:
    """The tier's bookkeeping alone (``TierBackend.unreadable``), times given."""
    backend = TierBackend(MemoryBackend(), "m")
    error = UnreadableObjects("eio", [False], [b"k"])
    assert backend.unreadable([b"k"], error, 0.0, read_others=True) == []
    backend.read_some([b"k"])  # it read fine since: that failure was a passing one
    assert backend.unreadable([b"k"], error, 1.0, read_others=True) == []
    assert backend.unreadable([b"k"], error, 2.0, read_others=True) == [b"k"]  # twice in a row
    assert backend.counters["read_errors"] == 3
    assert backend.usable(2.0)
    # Distinct objects failing with nothing read in between: the backend, not the objects.
    assert backend.unreadable([b"a"], error, 3.0, read_others=False) == []
    assert backend.unreadable([b"b"], error, 3.0, read_others=False) == []
    assert backend.usable(3.0)
    assert backend.unreadable([b"c"], error, 3.0, read_others=False) == []
    assert not backend.usable(3.0)
    assert backend.read_failures == {}  # nothing is blamed on them
    assert backend.unreadable([b"a"], error, 9.0, read_others=True) == []  # (a fresh count)
