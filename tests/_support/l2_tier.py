"""A server in the test's loop over a backend the test holds, and the protocol calls the L2
tier tests make on it (slot contents do not matter there)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from kvtrio.client import AsyncClient
from kvtrio.config import ServerConfig
from kvtrio.l2 import Backend, Buffers
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import (
    Commit,
    GetStats,
    LayoutSpec,
    Lookup,
    LookupReply,
    Release,
    Retrieve,
    RetrieveReply,
    StatsReply,
    Store,
    StoreReply,
)
from kvtrio.server import ServerHandle
from kvtrio.storage import token_chunk_hashes

from .serving import serving
from .waiting import await_async

__all__ = [
    "CHUNK",
    "HASHES",
    "LAYOUT",
    "PROMPT",
    "ParentsBackend",
    "cache",
    "lookup",
    "retrieve",
    "running",
    "stats",
    "store",
    "written_to_l2",
]

CHUNK = 256
PROMPT = tuple(range(7000, 7000 + 10 * CHUNK))
HASHES = tuple(token_chunk_hashes(PROMPT, CHUNK))
LAYOUT = LayoutSpec("flash_attn", 4, 256, 16, 2, 32, "float16")  # 256 KiB chunks


def running(
    config: ServerConfig, backend: Backend
) -> AbstractAsyncContextManager[tuple[ServerHandle, AsyncClient, AsyncClient]]:
    """A server over ``backend``, a registered worker client and a scheduler client
    (:func:`serving`)."""
    return serving(config, LAYOUT, [("l2", backend)])


async def stats(client: AsyncClient) -> StatsReply:
    return await client.call(GetStats(), StatsReply)


async def cache(client: AsyncClient) -> Any:
    reply = await stats(client)
    assert reply.cache is not None
    return reply.cache


async def store(worker: AsyncClient, request: str, chunks: int) -> None:
    reply = await worker.call(Store(request, 0, chunks * CHUNK, HASHES[:chunks]), StoreReply)
    written = tuple(HASHES[slot.chunk] for slot in reply.slots if slot.status == "write")
    await worker.request(Commit(request, written=written))


async def written_to_l2(client: AsyncClient, count: int) -> None:
    async def done() -> bool:
        return (await stats(client)).l2[0].counters.get("stores", 0) >= count

    await await_async(done, what=f"{count} chunks written to L2")


async def lookup(scheduler: AsyncClient, request: str, chunks: int = 10) -> LookupReply:
    return await scheduler.call(Lookup(request, "m", 1, HASHES[:chunks]), LookupReply)


async def retrieve(worker: AsyncClient, request: str, chunks: int = 10) -> dict[str, list[int]]:
    reply = await worker.call(Retrieve(request, 0, chunks * CHUNK, HASHES[:chunks]), RetrieveReply)
    by_status: dict[str, list[int]] = {}
    for slot in reply.slots:
        by_status.setdefault(slot.status, []).append(slot.chunk)
    if "read" in by_status:
        await worker.request(Release(request, tuple(HASHES[c] for c in by_status["read"])))
    return by_status


class ParentsBackend(MemoryBackend):
    """A real memory backend that takes (and records) each object's parent."""

    accepts_parents = True

    def __init__(self) -> None:
        super().__init__()
        self.parents: dict[bytes, bytes | None] = {}

    async def store(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Buffers],
        *,
        parents: Sequence[bytes | None] | None = None,
    ) -> list[bool]:
        assert parents is not None
        assert len(parents) == len(keys)
        self.parents.update(zip(keys, parents, strict=True))
        return await super().store(keys, buffers)
