"""The CPU worker adapter's pipelined copies, against a real server in the test's loop.

A store or retrieve is sent as batches of consecutive chunks (1, 2, 4, … chunks); each batch
stands alone when the server refuses it, a store is finished (future, ``get_finished``) only
once the server has answered its commit, and what the commit could not store is counted.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import trio

from kvtrio.client import AsyncClient, LoadStoreOp, WorkerAdapter, open_client
from kvtrio.client._copies import Span
from kvtrio.protocol import GetStats, Lookup, LookupReply, StatsReply, Unregister
from kvtrio.server import ServerHandle
from kvtrio.storage import token_chunk_hashes
from kvtrio.transfer import CpuTransfer

from .._support.waiting import await_async, await_condition

LAYERS, BLOCKS, BLOCK, CHUNK = 2, 320, 16, 256
PER_CHUNK = CHUNK // BLOCK
PROMPT = list(range(100, 100 + 10 * CHUNK))  # 10 chunks: batches of 1, 2, 4 and 3
HASHES = tuple(token_chunk_hashes(PROMPT, CHUNK))
SOURCE = list(range(10 * PER_CHUNK))
TARGET = list(range(BLOCKS - 1, BLOCKS - 1 - 10 * PER_CHUNK, -1))


def test_batches_double_up_to_the_byte_limit() -> None:
    def span(chunks: int, chunk_bytes: int) -> Span:
        return Span("r", 0, (b"h" * 16,) * chunks, b"", CHUNK, chunk_bytes, PER_CHUNK, ())

    assert span(10, 1 << 10).batches() == [range(1), range(1, 3), range(3, 7), range(7, 10)]
    assert span(7, 1 << 20).batches(limit=2 << 20) == [
        range(1),
        range(1, 3),
        range(3, 5),
        range(5, 7),
    ]
    assert span(3, 64 << 20).batches(limit=16 << 20) == [range(1), range(1, 2), range(2, 3)]
    assert span(0, 1 << 10).batches() == []


@pytest.fixture
async def scheduler(server: ServerHandle) -> AsyncIterator[AsyncClient]:
    async with open_client(server.endpoint) as client:
        yield client


@pytest.fixture
async def worker(server: ServerHandle) -> AsyncIterator[tuple[WorkerAdapter, list[np.ndarray]]]:
    rng = np.random.default_rng(17)
    shape = (2, BLOCKS, BLOCK, 2, 8)  # flash_attn
    arrays = [
        rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(np.float16) for _ in range(LAYERS)
    ]
    adapter = WorkerAdapter(server.endpoint, "m", 1, 0, BLOCK)
    caches = {f"layer.{i}": a for i, a in enumerate(arrays)}
    await trio.to_thread.run_sync(lambda: adapter.register_kv_caches(caches))
    await await_condition(lambda: adapter.registered, what="the adapter to register")
    yield adapter, arrays
    await trio.to_thread.run_sync(adapter.shutdown)


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


async def cache_stats(client: AsyncClient) -> Any:
    reply = await client.call(GetStats(), StatsReply)
    assert reply.cache is not None
    return reply.cache


async def hit_chunks(scheduler: AsyncClient, request: str, chunks: int = 10) -> int:
    reply = await scheduler.call(Lookup(request, "m", 1, HASHES[:chunks]), LookupReply)
    return reply.hit_chunks


async def test_a_store_in_batches_is_finished_once_committed_and_retrieved_byte_for_byte(
    worker: tuple[WorkerAdapter, list[np.ndarray]], scheduler: AsyncClient
) -> None:
    adapter, arrays = worker
    store = adapter.submit_store_request("s", LoadStoreOp(SOURCE, PROMPT, end=len(PROMPT)))
    await in_thread(store.result)
    assert await hit_chunks(scheduler, "r") == 10  # visible as soon as the store is finished
    assert await in_thread(lambda: adapter.get_finished(["s"])) == ({"s"}, set())
    op = LoadStoreOp(TARGET, PROMPT, end=len(PROMPT))
    await in_thread(adapter.submit_retrieve_request("r", op).result)
    assert await in_thread(adapter.get_block_ids_with_load_errors) == set()
    for array in arrays:
        assert np.array_equal(array[:, TARGET].view(np.uint16), array[:, SOURCE].view(np.uint16))
    assert adapter.metrics() == {
        "registered": True,
        "registration_failures": 0,
        "store_failures": {},
        "retrieve_failures": {},
    }

    async def released() -> bool:
        state = await cache_stats(scheduler)
        return (state.l1_ready, state.l1_pins, state.leases) == (10, 0, 0)

    await await_async(released, what="one release of every chunk read")


async def test_a_retrieve_of_what_the_server_lacks_is_reported_counted_and_said_once(
    worker: tuple[WorkerAdapter, list[np.ndarray]], caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing stored: every block of the retrieve is reported failed (the engine recomputes
    them), the chunks are counted by cause, and one warning names the request and the cause
    (a second failure with that cause is only counted)."""
    adapter, _ = worker
    op = LoadStoreOp(TARGET, PROMPT, end=len(PROMPT))
    with caplog.at_level(logging.WARNING, logger="kvtrio.client"):
        await in_thread(adapter.submit_retrieve_request("r", op).result)
        await in_thread(adapter.submit_retrieve_request("r2", op).result)
    assert await in_thread(adapter.get_block_ids_with_load_errors) == set(TARGET)
    assert adapter.metrics()["retrieve_failures"] == {"missing": 20}
    said = [r.getMessage() for r in caplog.records if "retrieve" in r.getMessage()]
    assert len(said) == 1
    assert "10 chunk(s) of r's retrieve were not loaded (missing)" in said[0]


@pytest.mark.parametrize("server_config", [{"max_pins": 5}], indirect=True)
async def test_a_batch_the_server_refuses_fails_only_its_own_chunks(
    worker: tuple[WorkerAdapter, list[np.ndarray]], scheduler: AsyncClient
) -> None:
    adapter, _ = worker
    store = adapter.submit_store_request("s", LoadStoreOp(SOURCE, PROMPT, end=len(PROMPT)))
    await in_thread(store.result)
    # Batches of 1 and 2 chunks fit in 5 pins; those of 4 and 3 (all sent at once) do not.
    assert adapter.metrics()["store_failures"] == {"server": 7}
    assert await hit_chunks(scheduler, "r", 5) == 3  # (a lookup of 10 would need 10 pins)
    assert await in_thread(lambda: adapter.get_finished(["s"])) == ({"s"}, set())


async def test_a_commit_the_server_refuses_is_counted_and_the_store_still_finishes(
    worker: tuple[WorkerAdapter, list[np.ndarray]],
    scheduler: AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    adapter, _ = worker
    gather = CpuTransfer.gather
    calls = []

    def gather_then_lose_the_registration(self: CpuTransfer, *args: Any) -> None:
        gather(self, *args)
        calls.append(args)
        if len(calls) == 1:  # the server forgets the registration before the commit
            adapter.client.request(Unregister())

    monkeypatch.setattr(CpuTransfer, "gather", gather_then_lose_the_registration)
    store = adapter.submit_store_request("s", LoadStoreOp(SOURCE, PROMPT, end=len(PROMPT)))
    await in_thread(store.result)
    assert len(calls) == 10
    assert adapter.metrics()["store_failures"] == {"not_registered": 10}
    assert await in_thread(lambda: adapter.get_finished(["s"])) == ({"s"}, set())
    await await_condition(lambda: adapter.registered, what="the adapter to register again")
    assert await hit_chunks(scheduler, "r") == 0  # nothing half-stored became visible
    state = await cache_stats(scheduler)
    assert (state.l1_ready, state.l1_writing) == (0, 0)


async def test_the_prompts_partial_chunk_is_stored_looked_up_and_loaded_to_the_last_block(
    worker: tuple[WorkerAdapter, list[np.ndarray]], server: ServerHandle
) -> None:
    """Issue 23: a prompt of 2 chunks, 6 whole blocks and 5 tokens is stored with its 6
    blocks as a partial chunk; the same prompt's lookup reaches its last whole block and
    the load moves exactly those blocks. A chunk can also be loaded in part."""
    from kvtrio.client import SchedulerAdapter

    adapter, arrays = worker
    prompt = PROMPT[: 2 * CHUNK + 6 * BLOCK + 5]
    tail_end = 2 * CHUNK + 6 * BLOCK
    store = adapter.submit_store_request("s", LoadStoreOp(SOURCE, prompt, end=len(prompt)))
    await in_thread(store.result)
    assert adapter.metrics()["store_failures"] == {}

    scheduler = SchedulerAdapter(server.endpoint, "m", 1, 0, BLOCK)
    try:
        await await_condition(lambda: scheduler.client.server_info is not None, what="hello")

        def hit(tokens: list[int], request: str) -> int | None:
            scheduler.maybe_submit_lookup_request(request, token_ids=tokens)
            return scheduler.check_lookup_result(request, wait=5.0)

        assert await in_thread(lambda: hit(prompt, "a")) == tail_end
        # Another tail (3 blocks, not 6) is another partial chunk: only the full chunks hit.
        assert await in_thread(lambda: hit(prompt[: 2 * CHUNK + 3 * BLOCK], "b")) == 2 * CHUNK
    finally:
        await in_thread(scheduler.close)

    target = TARGET[: 2 * PER_CHUNK + 7]
    before = [array[:, target[-1]].view(np.uint16).copy() for array in arrays]
    op = LoadStoreOp(target, prompt, end=tail_end)
    await in_thread(adapter.submit_retrieve_request("r", op).result)
    assert await in_thread(adapter.get_block_ids_with_load_errors) == set()
    moved = 2 * PER_CHUNK + 6
    for array, kept in zip(arrays, before, strict=True):
        view = array.view(np.uint16)
        assert np.array_equal(view[:, target[:moved]], view[:, SOURCE[:moved]])
        assert np.array_equal(view[:, target[-1]], kept)  # the block after the tail: untouched

    # A full chunk loaded in part: the first 2 chunks' blocks, but the last block left alone
    # (from token 100 on, the engine's own: skipped at the start too).
    again = [array[:, TARGET[: 2 * PER_CHUNK]].copy() for array in arrays]
    for array in arrays:
        array[:, TARGET[: 2 * PER_CHUNK]] = 0
    op = LoadStoreOp(TARGET, prompt, start=CHUNK, end=2 * CHUNK - BLOCK)
    await in_thread(adapter.submit_retrieve_request("r2", op).result)
    assert await in_thread(adapter.get_block_ids_with_load_errors) == set()
    for array, old in zip(arrays, again, strict=True):
        view, old16 = array.view(np.uint16), old.view(np.uint16)
        part = slice(PER_CHUNK, 2 * PER_CHUNK - 1)
        assert np.array_equal(view[:, TARGET[part]], old16[:, part])
        assert not view[:, TARGET[2 * PER_CHUNK - 1]].any()  # the last block: left alone
        assert not view[:, TARGET[:PER_CHUNK]].any()  # before start: not touched


class _ChunkAtATime:
    """A copy engine that is not the CPU one: scatters whole chunks only."""

    name = "chunks"

    def gather(self, layout: Any, layers: Any, block_ids: Any, out: Any) -> None:
        raise AssertionError("not used")

    def scatter(self, layout: Any, layers: Any, block_ids: Any, src: Any) -> None:
        assert src.nbytes == layout.chunk_nbytes(len(block_ids) * layout.block_size)
        CpuTransfer().scatter(layout, layers, block_ids, src)


@pytest.mark.parametrize("kind", ["flash_attn", "vllm_cpu"])
def test_a_retrieves_parts_are_scattered_alike_by_any_copy_engine(kind: str) -> None:
    """Parts of chunks (a partial last chunk, a chunk the engine has the start of) land in the
    same blocks whether the CPU engine copies them all at once or another a chunk at a time."""
    from kvtrio.client._arena_worker import ArenaCopies, _some_blocks
    from kvtrio.client._failures import Failures
    from kvtrio.transfer import KVLayout, gather

    layout = KVLayout(kind, LAYERS, 12, 4, 2, 8, "float16")
    rng = np.random.default_rng(3)
    size = layout.chunk_nbytes(layout.block_size)
    chunks = [rng.integers(0, 256, 3 * size, dtype=np.uint8) for _ in range(2)]
    parts: list[tuple[Any, np.ndarray, int]] = [
        ([5, 1, 7], chunks[0], 0),
        ([2], chunks[1], 1),
    ]
    results = []
    for transfer in (CpuTransfer(), _ChunkAtATime()):
        arrays = [np.zeros(layout.layer_shape, np.float16) for _ in range(LAYERS)]
        copies = ArenaCopies(None, layout, arrays, Failures(), lambda: None, transfer)  # type: ignore[arg-type]
        copies._scatter(parts)
        results.append([a.tobytes() for a in arrays])
        whole = np.empty(3 * size, np.uint8)
        gather(layout, arrays, [5, 1, 7], whole)
        assert whole.tobytes() == chunks[0].tobytes()
        one = np.empty(size, np.uint8)
        gather(layout, arrays, [2], one)
        assert one.tobytes() == _some_blocks(layout, chunks[1], 1, 2).tobytes()
    assert results[0] == results[1]
