"""The CUDA copy engine: whole operations between a GPU's layers and pinned L1, one launch each.

Everything here is written against the *driver boundary*, :class:`Device` (and
:class:`CudaRuntime` for IPC and pinning): in production :mod:`._cuda_torch` implements it with
torch (and the compiled kernels, or the pure-torch fallback); the tests implement it with a
simulated device that runs the host build of the kernels, so this module is tested on machines
without a GPU.

An operation (every chunk of a store or retrieve: :class:`~._batch.Operation`) is queued as:

* **mapped** (zero-copy, the default with the compiled kernels): ``[wait engine event] → one
  kernel → record done``, all on one stream. The L1 arena is page-locked *and mapped*
  (:class:`~._batch.PinnedHost`), the kernel reads or writes it directly through its device
  address; the segments (per chunk: block ids, device address of its L1 slot) travel in the
  launch's parameter. No staging buffer, no copy engine, no per-chunk host work.
* **staged** (the copy engine; the only mode of the pure-torch fallback): chunks are packed into
  two device staging buffers of ``staging_bytes`` in turn, one kernel per buffer-full, and
  copied between staging and L1 on a second stream, so one buffer's copy overlaps the next one's
  kernel::

      compute stream: [wait engine event] → wait staging b free → gather → record ready[b]
      copy stream:                          wait ready[b] → staging b → pinned L1 → record free[b]

  Retrieves mirror it.

Each operation ends by recording the caller's ``done`` event, so "done" means the bytes are in
place. Nothing here blocks: it only queues work on the streams; waiting for ``done`` is the
caller's business.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from ._batch import SEGMENT_DTYPE, Operation, PinnedHost, page_aligned, staged_segments
from ._cpu import _check_block_ids
from ._layouts import KVLayout

__all__ = [
    "MODES",
    "SEGMENT_DTYPE",
    "CopyPipeline",
    "CudaRuntime",
    "CudaTransfer",
    "Device",
    "Event",
    "IpcLayer",
    "Stream",
    "default_mode",
]

Array = npt.NDArray[Any]
log = logging.getLogger("kvtrio.cuda")


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


MODES = ("mapped", "staged")
"""How an operation reaches host memory: ``mapped`` (zero-copy: the kernel reads and writes
the page-locked L1 arena through its device address) or ``staged`` (the kernel fills a device
staging buffer, the copy engine moves it)."""


class Device(Protocol):
    """One GPU as the pipeline sees it. Every method only queues work, except where noted."""

    ordinal: int
    kernels: str
    """Which kernels copy: ``extension``, ``torch`` (the fallback) or something a fake names."""
    modes: tuple[str, ...]
    """The :data:`MODES` its kernels support, the preferred first."""

    def new_stream(self) -> Stream: ...

    def new_event(self) -> Event:
        """A new interprocess event (no timing)."""

    def open_event(self, handle: bytes) -> Event:
        """The event of another process, from its IPC handle."""

    def new_buffer(self, nbytes: int) -> Any:
        """``nbytes`` of device memory (blocking: allocates)."""

    def buffer_address(self, buffer: Any) -> int:
        """The device address of a buffer of :meth:`new_buffer`."""

    def mapped_address(self, host_address: int) -> int:
        """The device address of page-locked host memory (blocking; mapped mode only)."""

    def pin(self, memory: Array) -> Any:
        """Page-lock (and map) host memory (blocking); returns a token for :meth:`unpin`."""

    def unpin(self, token: Any) -> None: ...

    def prepare_layers(self, layout: KVLayout, tensors: Sequence[Any]) -> Any:
        """What the kernels need to address these layers, built once per registration
        (blocking: uploads the table of layer addresses)."""

    def run(
        self,
        layers: Any,
        op: Operation,
        segments: npt.NDArray[np.void],
        staging: Any,
        *,
        gather: bool,
        stream: Stream,
    ) -> None:
        """Gather (or scatter) every chunk of ``op``, every layer, in one launch: chunk bytes
        go to (come from) ``segments`` (:data:`SEGMENT_DTYPE`). ``staging`` is the device
        buffer the segments point into (staged mode: the chunks packed from its start), or
        None (mapped mode)."""

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


def default_mode(device: Device) -> str:
    """``KVTRIO_CUDA_COPY`` (``mapped`` or ``staged``) if the device's kernels support it, else
    the device's preferred mode; an unknown or unsupported value is logged and ignored."""
    wanted = os.environ.get("KVTRIO_CUDA_COPY", "").strip()
    if wanted in device.modes:
        return wanted
    if wanted:
        log.warning("KVTRIO_CUDA_COPY=%s: the %s kernels copy %s; using %s", wanted,
                    device.kernels, "/".join(device.modes), device.modes[0])  # fmt: skip
    return device.modes[0]


class CopyPipeline:
    """One device's copies between registered layers and pinned host memory (see module doc).

    One per device and chunk size. Methods may be called from any thread, one at a time (a lock
    serialises them); they return once the work is queued. ``mode`` is one of the device's
    :attr:`Device.modes` (by default :func:`default_mode`).
    """

    def __init__(
        self,
        device: Device,
        chunk_bytes: int,
        *,
        mode: str | None = None,
        staging_bytes: int = 32 << 20,
    ) -> None:
        mode = mode or default_mode(device)
        if mode not in device.modes:
            raise ValueError(f"{device.kernels} kernels copy {'/'.join(device.modes)}, not {mode}")
        self.device = device
        self.mode = mode
        self.chunk_bytes = chunk_bytes
        self.compute = device.new_stream()
        self._lock = threading.Lock()
        self.launches = 0
        if mode == "staged":  # two buffers of whole chunks, alternating
            per_buffer = max(1, staging_bytes // chunk_bytes)
            self.staging_bytes = per_buffer * chunk_bytes
            self.copy = device.new_stream()
            self._staging = [device.new_buffer(self.staging_bytes) for _ in range(2)]
            self._ready = [device.new_event() for _ in range(2)]
            self._free = [device.new_event() for _ in range(2)]
            self._used = [False, False]
            self._next = 0

    def _check(self, op: Operation) -> None:
        if any(row[1] > self.chunk_bytes for row in op.rows):
            raise ValueError(f"a chunk is bigger than the pipeline's chunks ({self.chunk_bytes})")

    def store(
        self, layers: Any, op: Operation, host: PinnedHost, after: Event | None, done: Event
    ) -> None:
        """Queue engine → host copies of ``op``'s chunks into ``host``; ``done`` completes when
        all are there. ``after`` (the engine's event) is waited for first; block id -1 puts
        zeros in that block's bytes of the chunk (every byte of each chunk is written)."""
        self._queue(layers, op, host, after, done, gather=True)

    def retrieve(
        self, layers: Any, op: Operation, host: PinnedHost, after: Event | None, done: Event
    ) -> None:
        """Queue host → engine copies of ``op``'s chunks; ``done`` completes when all are in
        place. ``after`` is waited for first; block id -1 leaves that engine block alone."""
        self._queue(layers, op, host, after, done, gather=False)

    def _queue(
        self,
        layers: Any,
        op: Operation,
        host: PinnedHost,
        after: Event | None,
        done: Event,
        *,
        gather: bool,
    ) -> None:
        self._check(op)
        device = self.device
        if self.mode == "mapped":  # one launch, one event: the kernel reaches L1 itself
            if not host.mapped(device.ordinal):
                host.map(device.ordinal, device.mapped_address)
            segments = host.segments(op, device.ordinal)
            with self._lock:
                if after is not None:
                    self.compute.wait_event(after)
                device.run(layers, op, segments, None, gather=gather, stream=self.compute)
                self.launches += 1
                done.record(self.compute)
            return
        with self._lock:
            if after is not None:
                self.compute.wait_event(after)
            per_buffer = self.staging_bytes // self.chunk_bytes
            for first in range(0, op.chunks, per_buffer):
                part = op.select(first, min(op.chunks, first + per_buffer))
                (self._store_part if gather else self._retrieve_part)(layers, part, host)
            done.record(self.copy if gather else self.compute)

    def _buffer(self) -> int:
        b = self._next
        self._next = 1 - b
        return b

    def _store_part(self, layers: Any, part: Operation, host: PinnedHost) -> None:
        """Gather into a staging buffer (compute stream), then copy out (copy stream)."""
        device, compute, copy = self.device, self.compute, self.copy
        b = self._buffer()
        if self._used[b]:
            compute.wait_event(self._free[b])
        segments = staged_segments(part, device.buffer_address(self._staging[b]))
        device.run(layers, part, segments, self._staging[b], gather=True, stream=compute)
        self.launches += 1
        self._ready[b].record(compute)
        copy.wait_event(self._ready[b])
        position = 0
        for offset, nbytes, _first, _count in part.rows:
            for piece in host.pieces(offset, nbytes):
                device.to_host(piece, self._staging[b], position, copy)
                position += piece.nbytes
        self._free[b].record(copy)
        self._used[b] = True

    def _retrieve_part(self, layers: Any, part: Operation, host: PinnedHost) -> None:
        """Copy into a staging buffer (copy stream), then scatter (compute stream)."""
        device, compute, copy = self.device, self.compute, self.copy
        b = self._buffer()
        if self._used[b]:
            copy.wait_event(self._free[b])
        position = 0
        for offset, nbytes, _first, _count in part.rows:
            for piece in host.pieces(offset, nbytes):
                device.to_device(self._staging[b], position, piece, copy)
                position += piece.nbytes
        self._ready[b].record(copy)
        compute.wait_event(self._ready[b])
        segments = staged_segments(part, device.buffer_address(self._staging[b]))
        device.run(layers, part, segments, self._staging[b], gather=False, stream=compute)
        self.launches += 1
        self._free[b].record(compute)
        self._used[b] = True


class CudaTransfer:
    """The CUDA engine behind the synchronous :class:`~kvtrio.transfer.Transfer` interface.

    For tests and benchmarks: each call runs one chunk through the pipeline and waits for it.
    ``layers`` are CUDA tensors (as the engine holds them); the host buffer is any numpy array,
    copied through a pinned bounce buffer of ``chunk_bytes`` (as the server's L1 is pinned).
    """

    def __init__(self, device: Device, chunk_bytes: int, mode: str | None = None) -> None:
        self.device = device
        self.pipeline = CopyPipeline(device, chunk_bytes, mode=mode)
        self.name = f"cuda-{device.kernels}-{self.pipeline.mode}"
        self._host = PinnedHost(device, page_aligned(chunk_bytes))
        weakref.finalize(self, self._host.close)  # unpinned before its memory goes
        self._done = device.new_event()
        self._prepared: dict[tuple[int, ...], Any] = {}

    def _layers(self, layout: KVLayout, layers: Sequence[Any]) -> Any:
        key = (hash(layout), *(id(layer) for layer in layers))
        if key not in self._prepared:
            self._prepared[key] = (self.device.prepare_layers(layout, layers), list(layers))
        return self._prepared[key][0]

    def _op(self, layout: KVLayout, block_ids: Any, buffer: Array, *, unique: bool) -> Operation:
        ids = _check_block_ids(layout, block_ids, unique=unique)
        nbytes = layout.chunk_nbytes(len(ids) * layout.block_size)
        if buffer.nbytes != nbytes or not buffer.flags.c_contiguous:
            raise ValueError(f"the chunk buffer must be {nbytes} contiguous bytes")
        return Operation.of([(ids.tolist(), 0, nbytes)])

    def gather(self, layout: KVLayout, layers: Sequence[Any], block_ids: Any, out: Array) -> None:
        op = self._op(layout, block_ids, out, unique=False)
        self.pipeline.store(self._layers(layout, layers), op, self._host, None, self._done)
        self._done.synchronize()
        out.reshape(-1).view(np.uint8)[...] = self._host.memory[: out.nbytes]

    def scatter(self, layout: KVLayout, layers: Sequence[Any], block_ids: Any, src: Array) -> None:
        op = self._op(layout, block_ids, src, unique=True)
        self._host.memory[: src.nbytes] = src.reshape(-1).view(np.uint8)
        self.pipeline.retrieve(self._layers(layout, layers), op, self._host, None, self._done)
        self._done.synchronize()
