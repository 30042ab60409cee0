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

from kvtrio.client import LoadStoreOp, SchedulerAdapter, WorkerAdapter, open_client
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
    # The prompt's partial chunk (its 6 whole blocks after the full chunks) is stored too
    # (issue 38): nothing is counted as not stored.
    assert adapter.metrics()["store_failures"] == {}

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


async def test_the_prompts_partial_chunk_is_stored_and_loaded_to_the_last_block(
    nursery: trio.Nursery, server_config: ServerConfig, host_library: Any
) -> None:
    """Issue 38: a CUDA worker stores a prompt of 2 chunks, 6 whole blocks and 4 tokens with
    its 6 blocks as a partial chunk (as CPU workers do); the prompt's lookup reaches its last
    whole block, and another CUDA worker (on the other GPU) and a CPU worker load exactly
    those blocks, with the same bytes."""
    server_gpus = FakeCuda(host_library, ["GPU-0", "GPU-1"])
    handle: ServerHandle = await nursery.start(
        lambda task_status: serve(
            server_config, cuda_runtime=lambda: server_gpus, task_status=task_status
        )
    )
    shape, tail_end, moved = (2, BLOCKS, BLOCK, 2, 8), 2 * CHUNK + 6 * BLOCK, 2 * PER_CHUNK + 6
    rng = np.random.default_rng(38)
    adapters: list[WorkerAdapter] = []

    async def cuda_worker(gpu: str, engine: str, fill: bool) -> tuple[WorkerAdapter, list[Any]]:
        gpus = server_gpus.process_view([gpu])
        adapter = WorkerAdapter(handle.endpoint, "m", 1, 0, BLOCK, engine_id=engine,
                                cuda_runtime=gpus)  # fmt: skip
        adapters.append(adapter)
        tensors = [gpus.empty(shape, "float16") for _ in range(LAYERS)]
        for tensor in tensors:
            if fill:
                tensor.array[...] = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
        caches = {f"layer.{i}": t for i, t in enumerate(tensors)}
        await trio.to_thread.run_sync(adapter.register_kv_caches, caches)
        await await_condition(lambda: adapter.registered, what="the adapter to register")
        return adapter, [t.array for t in tensors]

    try:
        writer, written = await cuda_worker("GPU-1", "a", fill=True)
        store = writer.submit_store_request("s", LoadStoreOp(SOURCE, PROMPT, end=len(PROMPT)))
        await trio.to_thread.run_sync(store.result, 10)
        assert writer.metrics()["store_failures"] == {}

        scheduler = SchedulerAdapter(handle.endpoint, "m", 1, 0, BLOCK, engine_id="a")
        try:
            await await_condition(lambda: scheduler.client.server_info is not None, what="hello")

            def hit() -> int | None:
                scheduler.maybe_submit_lookup_request("q", token_ids=PROMPT)
                return scheduler.check_lookup_result("q", wait=5.0)

            assert await trio.to_thread.run_sync(hit) == tail_end  # the last whole block
        finally:
            await trio.to_thread.run_sync(scheduler.close)

        reader, read = await cuda_worker("GPU-0", "b", fill=False)
        cpu = WorkerAdapter(handle.endpoint, "m", 1, 0, BLOCK, engine_id="c")
        adapters.append(cpu)
        host = [np.zeros(shape, np.float16) for _ in range(LAYERS)]
        caches = {f"layer.{i}": a for i, a in enumerate(host)}
        await trio.to_thread.run_sync(cpu.register_kv_caches, caches)
        await await_condition(lambda: cpu.registered, what="the CPU adapter to register")
        for adapter, arrays in ((reader, read), (cpu, host)):
            op = LoadStoreOp(TARGET, PROMPT, end=tail_end)
            await trio.to_thread.run_sync(adapter.submit_retrieve_request("r", op).result, 10)
            assert adapter.get_block_ids_with_load_errors() == set()
            for got, source in zip(arrays, written, strict=True):
                want = source.view(np.uint16)[:, SOURCE[:moved]]
                assert got.view(np.uint16)[:, TARGET[:moved]].tobytes() == want.tobytes()
                assert not got.view(np.uint16)[:, TARGET[moved:]].any()  # computed by the engine
    finally:
        for adapter in adapters:
            await trio.to_thread.run_sync(adapter.shutdown)
        handle.stop()
