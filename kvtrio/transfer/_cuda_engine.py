"""The CUDA copy engine: double-buffered chunk copies between a GPU's layers and pinned L1.

Everything here is written against the *driver boundary*, :class:`Device` (and
:class:`CudaRuntime` for IPC and pinning): in production :mod:`._cuda_torch` implements it with
torch (and the compiled kernels, or the pure-torch fallback); the tests implement it with a
simulated device that runs the host build of the kernels, so this module is tested on machines
without a GPU.

**Store** (engine → L1), per chunk, alternating between two staging buffers::

    compute stream: [wait engine event] → wait staging b free → gather kernel → record ready[b]
    copy stream:                          wait ready[b] → staging b → pinned L1 → record free[b]

so the device-to-host copy of chunk j overlaps the gather of chunk j + 1. **Retrieve** mirrors
it (host-to-device copies on the copy stream, scatter kernels on the compute stream, which waits
for the engine's event first). Each operation ends by recording the caller's ``done`` event, so
"done" means the bytes are in place. Nothing here blocks: it only queues work on the streams;
waiting for ``done`` is the caller's business.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from ._cpu import _check_block_ids
from ._layouts import KVLayout

__all__ = [
    "ChunkCopy",
    "CopyPipeline",
    "CudaRuntime",
    "CudaTransfer",
    "Device",
    "Event",
    "IpcLayer",
    "PinnedHost",
    "Stream",
]

Array = npt.NDArray[Any]


@attrs.frozen
class IpcLayer:
    """One layer's KV tensor, shared by CUDA IPC: torch's export of its storage
    (``UntypedStorage._share_cuda_()``) and the tensor's view of that storage.

    The wire carries the same fields as :class:`kvtrio.protocol.CudaLayer`; the worker and the
    server convert at their edges, so that this layer does not depend on the protocol."""

    handle: bytes
    """The IPC memory handle of the allocation holding the storage."""
    storage_size: int
    """Bytes of the storage."""
    storage_offset: int
    """Where the storage starts in the allocation, in bytes."""
    ref_counter_handle: bytes
    """torch's shared reference counter (a shared-memory file) that keeps the engine from
    freeing the storage while the server has it open."""
    ref_counter_offset: int
    event_handle: bytes
    """An IPC event torch recorded when it exported the storage (may be empty)."""
    event_sync_required: bool
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    """In elements."""
    offset: int
    """The tensor's offset into the storage, in elements."""
    dtype: str


class Event(Protocol):
    """An interprocess CUDA event (``torch.cuda.Event(interprocess=True)``)."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def ipc_handle(self) -> bytes: ...


class Stream(Protocol):
    def wait_event(self, event: Any) -> None: ...


class Device(Protocol):
    """One GPU as the pipeline sees it. Every method only queues work, except where noted."""

    ordinal: int
    kernels: str
    """Which kernels copy: ``extension``, ``torch`` (the fallback) or something a fake names."""

    def new_stream(self) -> Stream: ...

    def new_event(self) -> Event:
        """A new interprocess event (no timing)."""

    def open_event(self, handle: bytes) -> Event:
        """The event of another process, from its IPC handle."""

    def new_buffer(self, nbytes: int) -> Any:
        """``nbytes`` of device memory (blocking: allocates)."""

    def prepare_layers(self, layout: KVLayout, tensors: Sequence[Any]) -> Any:
        """What the kernels need to address these layers (blocking: may allocate)."""

    def upload_ids(self, ids: npt.NDArray[np.int64], stream: Stream) -> Any:
        """The block ids of an operation in device memory (an asynchronous copy on ``stream``)."""

    def kernel(
        self,
        layers: Any,
        ids: Any,
        host_ids: npt.NDArray[np.int64],
        first: int,
        buffer: Any,
        nbytes: int,
        *,
        gather: bool,
        stream: Stream,
    ) -> None:
        """Gather (or scatter) the blocks ``host_ids`` of every layer into (from) the first
        ``nbytes`` of ``buffer``; ``ids[first:first + len(host_ids)]`` are the same ids in
        device memory (from :meth:`upload_ids`)."""

    def to_host(self, host: Array, buffer: Any, offset: int, stream: Stream) -> None:
        """Copy ``host.nbytes`` bytes from ``buffer[offset:]`` into the host array."""

    def to_device(self, buffer: Any, offset: int, host: Array, stream: Stream) -> None:
        """Copy the host array into ``buffer[offset:]``."""


class CudaRuntime(Protocol):
    """The process's view of CUDA: devices, IPC, pinned memory. Blocking methods say so."""

    def device_uuids(self) -> list[str]:
        """The UUIDs of the GPUs this process sees, by ordinal."""

    def device(self, ordinal: int) -> Device:
        """The device of an ordinal (blocking the first time: builds or loads the kernels)."""

    def tensor_ordinal(self, tensor: Any) -> int | None:
        """The ordinal of a CUDA tensor, None for a CPU one."""

    def export_layer(self, tensor: Any) -> IpcLayer:
        """Share a tensor's storage by CUDA IPC (worker side)."""

    def open_layer(self, ordinal: int, layer: IpcLayer) -> Any:
        """Open another process's tensor (server side; blocking)."""

    def close_layer(self, tensor: Any) -> None:
        """Close what :meth:`open_layer` opened (blocking)."""

    def current_stream(self, ordinal: int) -> Stream:
        """The calling thread's current stream on that device (the engine's)."""

    def new_event(self, ordinal: int) -> Event:
        """A new interprocess event on that device (no kernels needed: for workers)."""

    def open_event(self, ordinal: int, handle: bytes) -> Event:
        """Another process's event, from its IPC handle."""

    def pin(self, memory: Array) -> Any:
        """Page-lock host memory for asynchronous copies (blocking); returns a token."""

    def unpin(self, token: Any) -> None: ...


@attrs.frozen
class ChunkCopy:
    """One chunk of an operation: its engine blocks and where its bytes are on the host.

    ``host`` is the L1 slot cut at pinned-region boundaries (:meth:`PinnedHost.pieces`), in
    order; their sizes add up to the chunk's bytes.
    """

    block_ids: tuple[int, ...]
    host: tuple[Array, ...]


class CopyPipeline:
    """Double-buffered copies between one device's layers and host chunks (see module doc).

    One per device. Methods may be called from any thread, one at a time (a lock serialises
    them); they return once the work is queued.
    """

    def __init__(self, device: Device, chunk_bytes: int, buffers: int = 2) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.compute = device.new_stream()
        self.copy = device.new_stream()
        self._staging = [device.new_buffer(chunk_bytes) for _ in range(buffers)]
        self._ready = [device.new_event() for _ in range(buffers)]
        self._free = [device.new_event() for _ in range(buffers)]
        self._used = [False] * buffers
        self._next = 0
        self._lock = threading.Lock()

    def _buffer(self) -> int:
        b = self._next
        self._next = (b + 1) % len(self._staging)
        return b

    def _ids(self, chunks: Sequence[ChunkCopy], stream: Stream) -> tuple[Any, Any]:
        ids = np.fromiter((i for c in chunks for i in c.block_ids), dtype=np.int64)
        return ids, self.device.upload_ids(ids, stream)

    def _check(self, chunks: Sequence[ChunkCopy]) -> None:
        for chunk in chunks:
            if sum(piece.nbytes for piece in chunk.host) > self.chunk_bytes:
                raise ValueError(f"a chunk is bigger than the staging buffers ({self.chunk_bytes})")

    def store(
        self, layers: Any, chunks: Sequence[ChunkCopy], after: Event | None, done: Event
    ) -> None:
        """Queue engine → host copies of ``chunks``; ``done`` completes when all are on the host.

        ``after`` (the engine's event) is waited for before the first gather.
        """
        self._check(chunks)
        device, compute, copy = self.device, self.compute, self.copy
        with self._lock:
            if after is not None:
                compute.wait_event(after)
            host_ids, ids = self._ids(chunks, compute)
            first = 0
            for chunk in chunks:
                b = self._buffer()
                nbytes = sum(piece.nbytes for piece in chunk.host)
                if self._used[b]:
                    compute.wait_event(self._free[b])
                count = len(chunk.block_ids)
                device.kernel(
                    layers, ids, host_ids[first : first + count], first, self._staging[b],
                    nbytes, gather=True, stream=compute,
                )  # fmt: skip
                first += count
                self._ready[b].record(compute)
                copy.wait_event(self._ready[b])
                offset = 0
                for piece in chunk.host:
                    device.to_host(piece, self._staging[b], offset, copy)
                    offset += piece.nbytes
                self._free[b].record(copy)
                self._used[b] = True
            done.record(copy)

    def retrieve(
        self, layers: Any, chunks: Sequence[ChunkCopy], after: Event | None, done: Event
    ) -> None:
        """Queue host → engine copies of ``chunks``; ``done`` completes when all are in place.

        ``after`` (the engine's event) is waited for before the first scatter. Block id -1
        leaves that block of the engine alone.
        """
        self._check(chunks)
        device, compute, copy = self.device, self.compute, self.copy
        with self._lock:
            if after is not None:
                compute.wait_event(after)
            host_ids, ids = self._ids(chunks, compute)
            first = 0
            for chunk in chunks:
                b = self._buffer()
                nbytes = sum(piece.nbytes for piece in chunk.host)
                if self._used[b]:
                    copy.wait_event(self._free[b])
                offset = 0
                for piece in chunk.host:
                    device.to_device(self._staging[b], offset, piece, copy)
                    offset += piece.nbytes
                self._ready[b].record(copy)
                compute.wait_event(self._ready[b])
                count = len(chunk.block_ids)
                device.kernel(
                    layers, ids, host_ids[first : first + count], first, self._staging[b],
                    nbytes, gather=False, stream=compute,
                )  # fmt: skip
                first += count
                self._free[b].record(compute)
                self._used[b] = True
            done.record(compute)


class PinnedHost:
    """Host memory (the L1 arena) page-locked in pieces of ``piece_bytes``.

    ``cudaHostRegister`` of one huge range is slow and may fail; pieces are registered one by
    one, and a copy is never handed a range that straddles two (:meth:`pieces` cuts it).
    """

    def __init__(self, runtime: CudaRuntime, memory: Array, piece_bytes: int = 1 << 30) -> None:
        self.memory = memory
        self.piece_bytes = piece_bytes
        self._runtime = runtime
        self._tokens: list[Any] = []
        try:
            for start in range(0, memory.nbytes, piece_bytes):
                self._tokens.append(runtime.pin(memory[start : start + piece_bytes]))
        except BaseException:
            self.close()
            raise

    def pieces(self, offset: int, nbytes: int) -> tuple[Array, ...]:
        """Views of ``[offset, offset + nbytes)``, cut where pinned pieces meet."""
        if offset < 0 or offset + nbytes > self.memory.nbytes:
            raise ValueError(f"[{offset}, {offset + nbytes}) is outside the pinned memory")
        views = []
        end = offset + nbytes
        while offset < end:
            stop = min(end, (offset // self.piece_bytes + 1) * self.piece_bytes)
            views.append(self.memory[offset:stop])
            offset = stop
        return tuple(views)

    def close(self) -> None:
        """Unpin every piece (blocking)."""
        tokens, self._tokens = self._tokens, []
        for token in tokens:
            self._runtime.unpin(token)


class CudaTransfer:
    """The CUDA engine behind the synchronous :class:`~kvtrio.transfer.Transfer` interface.

    For tests and benchmarks: each call runs one chunk through the pipeline and waits for it.
    ``layers`` are CUDA tensors (as the engine holds them); the host buffer is any numpy array.
    """

    def __init__(self, device: Device, chunk_bytes: int) -> None:
        self.device = device
        self.name = f"cuda-{device.kernels}"
        self.pipeline = CopyPipeline(device, chunk_bytes)
        self._done = device.new_event()
        self._prepared: dict[tuple[int, ...], Any] = {}

    def _layers(self, layout: KVLayout, layers: Sequence[Any]) -> Any:
        key = (hash(layout), *(id(layer) for layer in layers))
        if key not in self._prepared:
            self._prepared[key] = (self.device.prepare_layers(layout, layers), list(layers))
        return self._prepared[key][0]

    def _chunk(self, layout: KVLayout, block_ids: Any, buffer: Array, *, unique: bool) -> ChunkCopy:
        ids = _check_block_ids(layout, block_ids, unique=unique)
        nbytes = layout.chunk_nbytes(len(ids) * layout.block_size)
        if buffer.nbytes != nbytes or not buffer.flags.c_contiguous:
            raise ValueError(f"the chunk buffer must be {nbytes} contiguous bytes")
        return ChunkCopy(tuple(ids.tolist()), (buffer.reshape(-1).view(np.uint8),))

    def gather(self, layout: KVLayout, layers: Sequence[Any], block_ids: Any, out: Array) -> None:
        chunk = self._chunk(layout, block_ids, out, unique=False)
        self.pipeline.store(self._layers(layout, layers), [chunk], None, self._done)
        self._done.synchronize()

    def scatter(self, layout: KVLayout, layers: Sequence[Any], block_ids: Any, src: Array) -> None:
        chunk = self._chunk(layout, block_ids, src, unique=True)
        self.pipeline.retrieve(self._layers(layout, layers), [chunk], None, self._done)
        self._done.synchronize()
