"""CUDA workers in every tenant's L1 arena (issue 24 item 5), on simulated GPUs.

Two tenants over real CURVE (tcp on loopback), each with a CUDA worker whose layers are on the
same simulated GPU: each tenant's first CUDA registration pins (and maps) its own arena; the
server's copies put each tenant's chunks in its own arena, where its reply's slots say, and
retrieve them from there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvtrio.client import AsyncClient
from kvtrio.protocol import Lookup, LookupReply, Registered
from kvtrio.server.cache import CudaTransfers
from kvtrio.shm import SharedArena
from kvtrio.testing import FakeCuda

from .._support.cuda_worker import (
    HASHES,
    PER_CHUNK,
    SERVER_GPUS,
    SOURCE,
    TARGET,
    WORKER_GPUS,
    Worker,
)
from .._support.tenants import tcp_config, tenant_clients
from .._support.waiting import await_async


async def tenant_hits(client: AsyncClient, tenant: str) -> int:
    lookup = Lookup("probe", "m", 1, HASHES, engine="engine", tenant=tenant)
    return (await client.call(lookup, LookupReply)).hit_chunks


async def test_cuda_workers_of_two_tenants_use_their_own_arenas(
    short_dir: Path, host_library: Any
) -> None:
    server_gpus = FakeCuda(host_library, SERVER_GPUS)
    worker_gpus = server_gpus.process_view(WORKER_GPUS)
    config = tcp_config(l1_size=32 << 20, l1_tenants=2)
    async with tenant_clients(short_dir, config, cuda_runtime=lambda: server_gpus) as (
        server,
        acme_client,
        victim_client,
    ):
        transfers: CudaTransfers = server.state.cache.cuda  # type: ignore[attr-defined]
        workers: dict[str, tuple[Worker, Registered, AsyncClient]] = {}
        for seed, (tenant, client) in enumerate(
            (("acme", acme_client), ("victim", victim_client)), start=1
        ):
            worker = Worker(client, worker_gpus)
            worker.fill(seed)
            workers[tenant] = (worker, await worker.register(tenant=tenant), client)
        paths = {registered.arena_path for _w, registered, _c in workers.values()}
        assert len(paths) == 2  # two arenas...
        assert set(transfers.pinned) == paths  # ...each pinned at its tenant's registration

        for tenant, (worker, registered, client) in workers.items():
            reply = await worker.store(f"{tenant}-r", SOURCE)
            assert [s.status for s in reply.slots] == ["write"] * 3
            await worker.wait(reply.done_event)

            async def stored(client: AsyncClient = client, tenant: str = tenant) -> bool:
                return await tenant_hits(client, tenant) == 3

            await await_async(stored, what=f"{tenant}'s chunks committed")
            arena = SharedArena.attach(registered.arena_path, registered.arena_size)
            try:  # the bytes are in the tenant's own arena, where its slots say
                for slot in reply.slots:
                    blocks = SOURCE[slot.chunk * PER_CHUNK : (slot.chunk + 1) * PER_CHUNK]
                    got = arena.view(slot.offset, slot.nbytes).tobytes()
                    assert got == worker.canonical(blocks), tenant
            finally:
                arena.close()

        for tenant, (worker, _registered, _client) in workers.items():
            got = await worker.retrieve(f"{tenant}-r", TARGET)
            assert [s.status for s in got.slots] == ["read"] * 3
            await worker.wait(got.done_event)
            assert worker.per_layer(TARGET) == worker.per_layer(SOURCE), tenant
        acme, victim = workers["acme"][0], workers["victim"][0]
        assert acme.per_layer(TARGET) != victim.per_layer(TARGET)  # each its own KV
        assert np.any(acme.layers[0].array != victim.layers[0].array)
