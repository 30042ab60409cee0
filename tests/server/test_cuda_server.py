"""Server-driven CUDA transfers with the CUDA runtime simulated at the driver boundary.

The server runs for real (in the test's trio loop) with ``kvtrio.testing.FakeCuda``: GPUs with
UUIDs, IPC handles, streams and events that follow CUDA's ordering rules, and kernels that are
the host build of the real ones. The "worker" here is the test itself, with another process
view of the same GPUs (another ordinal order), talking the protocol directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import attrs
import numpy as np
import pytest
import trio

from kvtrio.client import AsyncClient, open_client
from kvtrio.config import ServerConfig
from kvtrio.errors import BadRequest
from kvtrio.protocol import (
    Commit,
    Register,
    Registered,
    Release,
    Store,
    StoreReply,
    Unregister,
)
from kvtrio.server import ServerHandle, serve
from kvtrio.server.cache import CudaTransfers
from kvtrio.shm import SharedArena
from kvtrio.storage import token_chunk_hashes
from kvtrio.testing import FakeCuda

from .._support.cuda_worker import (
    BLOCK,
    HASHES,
    LAYERS,
    PER_CHUNK,
    PROMPT,
    SERVER_GPUS,
    SOURCE,
    TARGET,
    WORKER_GPUS,
    Gpus,
    Worker,
    hits,
    wait_hits,
)
from .._support.waiting import await_async


@pytest.fixture
def gpus(host_library: Any) -> Gpus:
    server = FakeCuda(host_library, SERVER_GPUS)
    return Gpus(server, server.process_view(WORKER_GPUS))


@pytest.fixture
async def cuda_server(
    nursery: trio.Nursery, server_config: ServerConfig, gpus: Gpus
) -> AsyncIterator[ServerHandle]:
    handle: ServerHandle = await nursery.start(
        lambda task_status: serve(server_config, cuda_runtime=gpus.factory, task_status=task_status)
    )
    yield handle
    handle.stop()


@pytest.fixture
async def client(cuda_server: ServerHandle) -> AsyncIterator[AsyncClient]:
    async with open_client(cuda_server.endpoint, timeout=10) as client:
        yield client


@pytest.mark.parametrize("kind", ["flash_attn", "flash_infer", "mla"])
async def test_store_then_retrieve_through_ipc(client: AsyncClient, gpus: Gpus, kind: str) -> None:
    worker = Worker(client, gpus.worker, kind)
    worker.fill(1)
    registered = await worker.register()
    assert gpus.server.open_layers == LAYERS
    assert gpus.server.pinned  # L1 is pinned once CUDA is in use

    reply = await worker.store("r1", SOURCE)
    assert [s.status for s in reply.slots] == ["write"] * 3
    await worker.wait(reply.done_event)
    await wait_hits(client, 3)  # committed by the server once its event completed
    arena = SharedArena.attach(registered.arena_path, registered.arena_size)
    try:
        for slot in reply.slots:
            blocks = SOURCE[slot.chunk * PER_CHUNK : (slot.chunk + 1) * PER_CHUNK]
            assert arena.view(slot.offset, slot.nbytes).tobytes() == worker.canonical(blocks)
    finally:
        arena.close()

    got = await worker.retrieve("r1", TARGET)
    assert [s.status for s in got.slots] == ["read"] * 3
    await worker.wait(got.done_event)
    assert worker.per_layer(TARGET) == worker.per_layer(SOURCE)
    assert gpus.server.gpu.kernels == 2  # one launch per operation: every chunk, every layer


async def test_the_copy_waits_for_the_engine_event(client: AsyncClient, gpus: Gpus) -> None:
    """The engine's forward step is still running when the store arrives: the server's copy
    waits for its event, nothing is committed until the server's own event completed, and the
    bytes stored are the ones the forward step wrote."""
    worker = Worker(client, gpus.worker)
    worker.fill(1)
    await worker.register()
    gpus.worker.hold(worker.stream)  # the GPU is busy with the forward step
    fresh = [np.random.default_rng(9).integers(0, 1 << 16, t.array.shape, dtype=np.uint16)
             for t in worker.layers]  # fmt: skip

    def forward_step() -> None:
        for tensor, data in zip(worker.layers, fresh, strict=True):
            tensor.array[...] = data

    gpus.worker.on_stream(worker.stream, forward_step)
    reply = await worker.store("r2", SOURCE)
    done = worker.device.open_event(reply.done_event)
    await trio.sleep(0.05)
    assert not done.query()
    assert await hits(client) == 0  # not visible while being written
    gpus.worker.release(worker.stream)
    await worker.wait(reply.done_event)
    await wait_hits(client, 3)
    expected = worker.canonical(SOURCE[:PER_CHUNK])
    got = await worker.retrieve("r2", TARGET)
    await worker.wait(got.done_event)
    assert worker.canonical(TARGET[:PER_CHUNK]) == expected
    assert worker.per_layer(TARGET) == worker.per_layer(SOURCE)


async def test_a_store_the_worker_saw_done_is_visible_to_its_next_lookup(
    cuda_server: ServerHandle, client: AsyncClient, gpus: Gpus
) -> None:
    """The worker's future is done when the server's done event has completed; the lookup it
    sends next must see the chunks even if the server's completion watcher has not run yet
    (here it cannot: its thread limiter is held)."""
    transfers: CudaTransfers = cast(Any, cuda_server.state.cache).cuda
    worker = Worker(client, gpus.worker)
    worker.fill(3)
    await worker.register()
    holder = object()
    await transfers.wait_limiter.acquire_on_behalf_of(holder)
    try:
        reply = await worker.store("r3", SOURCE)
        await worker.wait(reply.done_event)
        assert await hits(client) == 3
        got = await worker.retrieve("r3", TARGET)
        await worker.wait(got.done_event)
        assert worker.per_layer(TARGET) == worker.per_layer(SOURCE)
    finally:
        transfers.wait_limiter.release_on_behalf_of(holder)


async def test_a_cuda_worker_cannot_commit_or_release_what_the_server_copies(
    client: AsyncClient, gpus: Gpus
) -> None:
    """The server ends a CUDA worker's copies itself: a commit sent while the copy still waits
    would show an unwritten slot, a release unpin one a queued copy reads. Both are refused."""
    worker = Worker(client, gpus.worker)
    worker.fill(5)
    await worker.register()
    gpus.worker.hold(worker.stream)  # the forward step is still running: the copy waits
    reply = await worker.store("r5", SOURCE)
    with pytest.raises(BadRequest, match="'commit' is not for CUDA workers"):
        await client.request(Commit("r5", written=HASHES))
    assert await hits(client) == 0  # nothing visible before the server's copy is done
    with pytest.raises(BadRequest, match="'release' is not for CUDA workers"):
        await client.request(Release("r5", HASHES))
    gpus.worker.release(worker.stream)
    await worker.wait(reply.done_event)
    await wait_hits(client, 3)


async def test_retrieve_leaves_blocks_marked_minus_one_alone(
    client: AsyncClient, gpus: Gpus
) -> None:
    worker = Worker(client, gpus.worker)
    worker.fill(1)
    await worker.register()
    reply = await worker.store("r3", SOURCE)
    await worker.wait(reply.done_event)
    await wait_hits(client, 3)
    kept = worker.per_layer(TARGET[:PER_CHUNK])
    got = await worker.retrieve("r3", [-1] * PER_CHUNK + TARGET[PER_CHUNK:])
    await worker.wait(got.done_event)
    assert worker.per_layer(TARGET[:PER_CHUNK]) == kept
    assert worker.per_layer(TARGET[PER_CHUNK:]) == worker.per_layer(SOURCE[PER_CHUNK:])


@pytest.mark.parametrize("mode", ["mapped", "staged"])
async def test_a_partial_chunk_is_stored_with_zeros_after_its_blocks(
    client: AsyncClient, gpus: Gpus, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store's last chunk may name -1 for its trailing blocks (the prompt's partial chunk):
    its slot holds those blocks, then zeros, whatever L1 or the staging buffers held before
    (the GPU writes every byte of the slot); it is committed, and loads back block for block."""
    monkeypatch.setenv("KVTRIO_CUDA_COPY", mode)
    worker = Worker(client, gpus.worker)
    worker.fill(1)
    registered = await worker.register()
    arena = SharedArena.attach(registered.arena_path, registered.arena_size)
    try:
        arena.view(0, arena.size).fill(0xA5)  # what earlier chunks could have left there
        for other in (1, 2):  # fill both staging buffers with other chunks first
            hashes = tuple(token_chunk_hashes([t + other for t in PROMPT], PER_CHUNK * BLOCK))
            done = await worker.client.call(
                Store(f"o{other}", 0, len(PROMPT), hashes, block_ids=tuple(TARGET),
                      event=worker.record()),
                StoreReply,
            )  # fmt: skip
            await worker.wait(done.done_event)
        kept = 2 * PER_CHUNK + 5  # two full chunks, then 5 blocks of the third
        blocks = SOURCE[:kept] + [-1] * (3 * PER_CHUNK - kept)
        reply = await worker.store("p", blocks)
        assert [s.status for s in reply.slots] == ["write"] * 3
        await worker.wait(reply.done_event)
        await wait_hits(client, 3)
        last = reply.slots[2]
        partial = arena.view(last.offset, last.nbytes)
        assert partial.tobytes() == partial_bytes(worker, SOURCE[2 * PER_CHUNK : kept])
        tokens = partial.view(np.uint16).reshape(worker.layout.chunk_shape(PER_CHUNK * BLOCK))
        assert not tokens[:, :, (kept - 2 * PER_CHUNK) * BLOCK :].any()  # zeros after the blocks
    finally:
        arena.close()

    targets = TARGET[:kept] + [-1] * (3 * PER_CHUNK - kept)
    untouched = worker.per_layer(TARGET[kept:])
    got = await worker.retrieve("p", targets)
    assert [s.status for s in got.slots] == ["read"] * 3
    await worker.wait(got.done_event)
    assert worker.per_layer(TARGET[:kept]) == worker.per_layer(SOURCE[:kept])
    assert worker.per_layer(TARGET[kept:]) == untouched


def partial_bytes(worker: Worker, blocks: list[int]) -> bytes:
    """The canonical partial chunk of ``blocks``: their tokens, then zeros to a full chunk."""
    layout = worker.layout
    whole = np.zeros(layout.chunk_shape(PER_CHUNK * BLOCK), np.uint16)
    part = np.frombuffer(worker.canonical(blocks), np.uint16)
    whole[:, :, : len(blocks) * BLOCK] = part.reshape(layout.chunk_shape(len(blocks) * BLOCK))
    return whole.tobytes()


async def test_handles_are_opened_once_and_closed_with_the_registration(
    client: AsyncClient, gpus: Gpus
) -> None:
    worker = Worker(client, gpus.worker)
    await worker.register()
    await worker.register()  # replaces the first: its handles are closed
    await await_async(lambda: _equals(_open(gpus), LAYERS), what="the old handles closed")
    assert gpus.server.gpu.opened_total == 2 * LAYERS
    await client.request(Unregister())
    await await_async(lambda: _equals(_open(gpus), 0), what="the handles closed")
    assert gpus.factory_calls == 1  # one runtime for the server's life


async def _equals(value: Any, expected: int) -> bool:
    return bool(await value == expected)


async def _open(gpus: Gpus) -> int:
    await trio.lowlevel.checkpoint()
    return gpus.server.open_layers


async def test_unregister_closes_only_after_queued_copies(client: AsyncClient, gpus: Gpus) -> None:
    """An IPC mapping is never closed under a copy: closing waits for the queued work."""
    worker = Worker(client, gpus.worker)
    await worker.register()
    gpus.worker.hold(worker.stream)
    reply = await worker.store("r4", SOURCE)
    await client.request(Unregister())
    await trio.sleep(0.05)
    assert gpus.server.open_layers == LAYERS
    gpus.worker.release(worker.stream)
    await worker.wait(reply.done_event)
    await await_async(lambda: _equals(_open(gpus), 0), what="the handles closed")
    assert await hits(client) == 0  # the worker left before the copy finished: nothing stored


@pytest.mark.parametrize("server_config", [{"heartbeat_timeout": 0.3}], indirect=True)
async def test_session_death_closes_the_handles(cuda_server: ServerHandle, gpus: Gpus) -> None:
    async with open_client(cuda_server.endpoint, timeout=5, heartbeat=False) as client:
        await Worker(client, gpus.worker).register()
        assert gpus.server.open_layers == LAYERS
    await await_async(lambda: _equals(_open(gpus), 0), what="the session's handles closed")


def _tamper(field: str, value: Any) -> Callable[[Register], Register]:
    def change(request: Register) -> Register:
        assert request.cuda is not None
        layers = list(request.cuda.layers)
        layers[1] = attrs.evolve(layers[1], **{field: value})
        return attrs.evolve(request, cuda=attrs.evolve(request.cuda, layers=tuple(layers)))

    return change


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda r: attrs.evolve(r, cuda=attrs.evolve(r.cuda, device_uuid="GPU-zzzz")),
         r"GPU GPU-zzzz is not visible to the kvtrio server \(it sees GPU-aaaa, GPU-bbbb\)"),
        (lambda r: attrs.evolve(r, cuda=None), r"needs the 'cuda' field"),
        (lambda r: attrs.evolve(r, device="cpu"), r"the 'cuda' field needs device 'cuda'"),
        (lambda r: attrs.evolve(r, device="tpu"), r"device 'tpu': expected 'cpu'"),
        (lambda r: attrs.evolve(r, cuda=attrs.evolve(r.cuda, layers=r.cuda.layers[:2])),
         r"2 CUDA layers for a layout of 3"),
        (_tamper("storage_size", 1000), r"layer 1: .* beyond the 1000 bytes of its memory"),
        (_tamper("shape", (2, 64, 16, 2, 4)), r"layer 1: shape \(2, 64, 16, 2, 4\)"),
        (_tamper("dtype", "bfloat16"), r"layer 1: dtype bfloat16"),
        (_tamper("stride", (0, 0, 0, 0, 1)), r"all layers must have the same strides"),
        (_tamper("handle", b"x" * 64), r"cannot open the KV cache's CUDA IPC handles"),
    ],
)  # fmt: skip
async def test_bad_registrations_are_refused(
    client: AsyncClient, gpus: Gpus, change: Callable[[Register], Register], match: str
) -> None:
    worker = Worker(client, gpus.worker)
    with pytest.raises(BadRequest, match=match):
        await client.call(change(worker.register_request()), Registered)
    assert gpus.server.open_layers == 0
    await worker.register()  # the session is fine afterwards


async def test_a_server_without_cuda_says_so(client: AsyncClient, gpus: Gpus) -> None:
    gpus.available = False
    with pytest.raises(BadRequest, match=r"no usable CUDA .* torch built with CUDA"):
        await Worker(client, gpus.worker).register()


async def test_l1_that_cannot_be_pinned_is_reported(client: AsyncClient, gpus: Gpus) -> None:
    gpus.server.fail_pin = "cudaErrorMemoryAllocation"
    with pytest.raises(BadRequest, match=r"cannot pin the L1 arena .*ulimit -l"):
        await Worker(client, gpus.worker).register()


async def test_bad_block_ids_are_refused_and_leave_nothing_behind(
    client: AsyncClient, gpus: Gpus
) -> None:
    worker = Worker(client, gpus.worker)
    await worker.register()
    with pytest.raises(BadRequest, match="need 48 block ids, got 47"):
        await worker.store("r5", SOURCE[:-1])
    with pytest.raises(BadRequest, match=r"ints in \[-1, 128\)"):
        await worker.store("r5", [*SOURCE[:-1], 128])
    with pytest.raises(BadRequest, match=r"ints in \[-1, 128\)"):
        await worker.store("r5", [*SOURCE[:-1], -2])
    tail = 3 * PER_CHUNK - 5
    for blocks in (
        [-1, *SOURCE[1:]],  # -1 in a chunk that is not the last
        [*SOURCE[:PER_CHUNK], -1, *SOURCE[PER_CHUNK + 1 :]],
        [*SOURCE[: 2 * PER_CHUNK], *[-1] * PER_CHUNK],  # a last chunk of no block
        [*SOURCE[:tail], -1, SOURCE[tail + 1], -1, -1, -1],  # a hole in the last chunk
    ):
        with pytest.raises(BadRequest, match="-1 only for the trailing blocks of its last"):
            await worker.store("r5", blocks)
    with pytest.raises(BadRequest, match="cannot open the engine's CUDA event"):
        await worker.client.call(
            Store("r5", 0, len(PROMPT), HASHES, block_ids=tuple(SOURCE),
                  event=b"?" * 64),
            StoreReply,
        )  # fmt: skip
    reply = await worker.store("r5", SOURCE)  # nothing was left reserved by the failures
    assert [s.status for s in reply.slots] == ["write"] * 3
    await worker.wait(reply.done_event)
    with pytest.raises(BadRequest, match="must differ"):
        await worker.retrieve("r5", [1] * len(TARGET))
