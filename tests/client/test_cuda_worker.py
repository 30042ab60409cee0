"""The worker adapter with CUDA tensors, against a real server, CUDA simulated at the driver.

The adapter exports its (fake) CUDA tensors by IPC, records the engine's event when an
operation is submitted, and its future is done only once the server's event has completed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import trio

from kvtrio.client import LoadStoreOp, WorkerAdapter, open_client
from kvtrio.config import ServerConfig
from kvtrio.protocol import Lookup, LookupReply
from kvtrio.server import ServerHandle, serve
from kvtrio.storage import token_chunk_hashes
from kvtrio.testing import FakeCuda

from .._support.waiting import await_condition

LAYERS, BLOCKS, BLOCK, CHUNK = 2, 96, 16, 256
PER_CHUNK = CHUNK // BLOCK
PROMPT = list(range(7, 7 + 2 * CHUNK + 100))  # two full chunks and a bit
SOURCE = list(range(40))
TARGET = list(range(95, 55, -1))


@pytest.fixture
async def setup(
    nursery: trio.Nursery, server_config: ServerConfig, host_library: Any
) -> AsyncIterator[tuple[ServerHandle, FakeCuda, WorkerAdapter]]:
    server_gpus = FakeCuda(host_library, ["GPU-0", "GPU-1"])
    handle: ServerHandle = await nursery.start(
        lambda task_status: serve(
            server_config, cuda_runtime=lambda: server_gpus, task_status=task_status
        )
    )
    worker_gpus = server_gpus.process_view(["GPU-1"])
    adapter = WorkerAdapter(handle.endpoint, "m", 1, 0, BLOCK, cuda_runtime=worker_gpus)
    yield handle, worker_gpus, adapter
    await trio.to_thread.run_sync(adapter.shutdown)
    handle.stop()


async def test_store_and_retrieve_through_the_adapter(
    setup: tuple[ServerHandle, FakeCuda, WorkerAdapter],
) -> None:
    handle, gpus, adapter = setup
    tensors = {
        f"layer.{i}": gpus.empty((2, BLOCKS, BLOCK, 2, 8), "bfloat16") for i in range(LAYERS)
    }
    rng = np.random.default_rng(4)
    for tensor in tensors.values():
        tensor.array[...] = rng.integers(0, 1 << 16, tensor.array.shape, dtype=np.uint16)
    await trio.to_thread.run_sync(adapter.register_kv_caches, tensors)
    await await_condition(lambda: adapter.registered, what="the adapter to register")

    stream = gpus.current_stream(0)
    gpus.hold(stream)  # the forward step is still running when the store is submitted
    store = adapter.submit_store_request("r", LoadStoreOp(SOURCE, PROMPT, end=len(PROMPT)))
    await trio.sleep(0.05)
    assert not store.done()
    gpus.release(stream)
    await trio.to_thread.run_sync(store.result, 10)

    async with open_client(handle.endpoint) as client:
        reply = await client.call(
            Lookup("q", "m", 1, tuple(token_chunk_hashes(PROMPT, CHUNK))), LookupReply
        )
    assert reply.hit_chunks == 2
    # The prompt's partial chunk (its 6 whole blocks after the full chunks) is not stored by
    # CUDA workers: counted, not silently dropped.
    assert adapter.metrics()["store_failures"] == {"partial_on_cuda": 1}

    # Retrieve into other blocks what the lookup found; the engine already has the first
    # chunk's first 2 blocks.
    op = LoadStoreOp(TARGET, PROMPT, end=2 * CHUNK, skip_first_n_tokens=2 * BLOCK)
    before = [t.array[:, TARGET[:2]].copy() for t in tensors.values()]
    await trio.to_thread.run_sync(adapter.submit_retrieve_request("r", op).result, 10)
    assert adapter.get_block_ids_with_load_errors() == set()
    for tensor, kept in zip(tensors.values(), before, strict=True):
        array = tensor.array
        assert array[:, TARGET[:2]].tobytes() == kept.tobytes()
        moved = 2 * PER_CHUNK
        assert array[:, TARGET[2:moved]].tobytes() == array[:, SOURCE[2:moved]].tobytes()
    assert adapter.get_finished([])[1] == {"r"}

    # Issue 23: a load to a block boundary inside a chunk leaves the chunk's later blocks alone
    # (-1 to the server): the engine computes them.
    for tensor in tensors.values():
        tensor.array[:, TARGET] = 0
    op = LoadStoreOp(TARGET, PROMPT, end=2 * CHUNK - BLOCK)
    await trio.to_thread.run_sync(adapter.submit_retrieve_request("r2", op).result, 10)
    assert adapter.get_block_ids_with_load_errors() == set()
    for tensor in tensors.values():
        array = tensor.array
        moved = 2 * PER_CHUNK - 1
        assert array[:, TARGET[:moved]].tobytes() == array[:, SOURCE[:moved]].tobytes()
        assert not array[:, TARGET[moved]].any()
