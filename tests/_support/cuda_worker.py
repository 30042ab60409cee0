"""A CUDA engine worker on the simulated GPUs of ``kvtrio.testing.FakeCuda``, talking the
protocol by hand, and the GPUs of a test (the server's view and the worker's)."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import trio

from kvtrio.client import AsyncClient
from kvtrio.protocol import (
    CudaCache,
    CudaLayer,
    LayoutSpec,
    Lookup,
    LookupReply,
    Register,
    Registered,
    Retrieve,
    RetrieveReply,
    Store,
    StoreReply,
)
from kvtrio.storage import HASH_SCHEME_TOKENS, token_chunk_hashes
from kvtrio.testing import FakeCuda
from kvtrio.transfer import KVLayout, gather

from .waiting import await_async

__all__ = [
    "BLOCK",
    "BLOCKS",
    "HASHES",
    "LAYERS",
    "PER_CHUNK",
    "PROMPT",
    "SERVER_GPUS",
    "SOURCE",
    "TARGET",
    "WORKER_GPUS",
    "Gpus",
    "Worker",
    "hits",
    "wait_hits",
]

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 128, 16, 2, 8
CHUNK = 256
PER_CHUNK = CHUNK // BLOCK
PROMPT = list(range(1000, 1000 + 3 * CHUNK))
HASHES = tuple(token_chunk_hashes(PROMPT, CHUNK))
SERVER_GPUS = ["GPU-aaaa", "GPU-bbbb"]
WORKER_GPUS = ["GPU-bbbb", "GPU-aaaa"]  # another CUDA_VISIBLE_DEVICES order


@attrs.define
class Gpus:
    server: FakeCuda
    worker: FakeCuda
    factory_calls: int = 0
    available: bool = True

    def factory(self) -> FakeCuda | None:
        self.factory_calls += 1
        return self.server if self.available else None


class Worker:
    """A CUDA engine worker: KV layers on a fake GPU, its own stream, the protocol by hand."""

    def __init__(self, client: AsyncClient, cuda: FakeCuda, kind: str = "flash_attn") -> None:
        self.client = client
        self.cuda = cuda
        heads, dim = (1, 24) if kind == "mla" else (HEADS, DIM)
        self.layout = KVLayout(kind, LAYERS, BLOCKS, BLOCK, heads, dim, "float16")
        self.ordinal = 0  # this process's GPU 0 is the server's GPU 1
        self.layers = [
            cuda.empty(self.layout.layer_shape, "float16", self.ordinal, pad=256)
            for _ in range(LAYERS)
        ]
        self.stream = cuda.current_stream(self.ordinal)
        self.device = cuda.device(self.ordinal)
        self.event = self.device.new_event()

    def fill(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for layer in self.layers:
            layer.array[...] = rng.integers(0, 1 << 16, layer.array.shape, dtype=np.uint16)

    def register_request(self, **changes: Any) -> Register:
        layout = self.layout
        spec = LayoutSpec(layout.kind, LAYERS, BLOCKS, BLOCK, layout.num_heads,
                          layout.head_dim, "float16")  # fmt: skip
        layers = (attrs.asdict(self.cuda.export_layer(t), recurse=False) for t in self.layers)
        cuda = CudaCache(self.cuda.uuids[self.ordinal], tuple(CudaLayer(**x) for x in layers))
        fields: dict[str, Any] = {
            "engine": "engine", "model": "m", "world_size": 1, "rank": 0, "layout": spec,
            "hash_scheme": HASH_SCHEME_TOKENS, "device": "cuda", "cuda": cuda,
        }  # fmt: skip
        return Register(**{**fields, **changes})

    async def register(self, **changes: Any) -> Registered:
        return await self.client.call(self.register_request(**changes), Registered)

    def record(self) -> bytes:
        """Record the engine's event after its (queued) forward step; its IPC handle."""
        self.event.record(self.stream)
        return self.event.ipc_handle()

    async def wait(self, handle: bytes) -> None:
        """What the adapter does: open the server's event and wait for it (in a thread)."""
        assert handle
        event = self.device.open_event(handle)
        await trio.to_thread.run_sync(event.synchronize)

    async def store(self, request: str, blocks: list[int], **more: Any) -> StoreReply:
        store = Store(request, 0, len(PROMPT), HASHES, block_ids=tuple(blocks),
                      event=self.record(), **more)  # fmt: skip
        return await self.client.call(store, StoreReply)

    async def retrieve(self, request: str, blocks: list[int]) -> RetrieveReply:
        retrieve = Retrieve(request, 0, len(PROMPT), HASHES,
                            block_ids=tuple(blocks), event=self.record())  # fmt: skip
        return await self.client.call(retrieve, RetrieveReply)

    def canonical(self, blocks: list[int]) -> bytes:
        out = np.zeros(self.layout.chunk_nbytes(len(blocks) * BLOCK), np.uint8)
        gather(self.layout, [t.array for t in self.layers], blocks, out)
        return out.tobytes()

    def per_layer(self, blocks: list[int]) -> list[bytes]:
        if self.layout.kind == "flash_attn":
            return [t.array[:, blocks].tobytes() for t in self.layers]
        return [t.array[blocks].tobytes() for t in self.layers]


async def hits(client: AsyncClient) -> int:
    reply = await client.call(Lookup("probe", "m", 1, HASHES, engine="engine"), LookupReply)
    return reply.hit_chunks


async def wait_hits(client: AsyncClient, expected: int) -> None:
    await await_async(lambda: _equals(hits(client), expected), what=f"{expected} chunks stored")


async def _equals(value: Any, expected: int) -> bool:
    return bool(await value == expected)


SOURCE = list(range(3 * PER_CHUNK))
TARGET = list(range(BLOCKS - 1, BLOCKS - 1 - 3 * PER_CHUNK, -1))
