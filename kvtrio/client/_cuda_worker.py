"""The copy path of CUDA tensors: the server copies over CUDA IPC; the worker hands it events.

With CUDA tensors the server copies (``docs/gpu.md``): this :class:`~._copies.WorkerCopies`
describes the layers (IPC handles, shape/stride/offset/dtype, the GPU's UUID) for the
``register`` message, records an interprocess event on the engine's current stream when an
operation is submitted (after the forward step the engine queued), sends the operation's engine
blocks with that event and, once the server answers, waits for the server's event, so that an
operation is done only when the bytes are in place. There is nothing to commit or release: the
server does it when its copies complete.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import attrs

from ..errors import NotRegistered
from ..protocol import CudaCache, CudaLayer, Registered, Reply, RetrieveReply, StoreReply
from ..transfer.cuda import CudaRuntime, Event, IpcLayer
from ._copies import Retrieved, Span, count_failed_slots, failure_cause, reply_of
from ._failures import Failures
from ._sync import Client
from ._tensors import describe_cuda_caches

__all__ = ["CudaCopies", "is_cuda_cache"]

_EVENTS = 16
"""Interprocess events used in turn for the engine side of operations. Reusing one early only
makes the server wait longer (for a later forward step), never less."""


def _wire(layer: IpcLayer) -> CudaLayer:
    """A layer as the ``register`` message carries it (the same fields)."""
    return CudaLayer(**attrs.asdict(layer, recurse=False))


def is_cuda_cache(kv_caches: Mapping[str, Any], runtime: CudaRuntime | None) -> bool:
    """Whether the engine's KV tensors are CUDA tensors (without importing torch): the
    ``runtime``'s answer when one is given, else the tensors' ``device.type``."""
    first = next(iter(kv_caches.values()), None)
    if runtime is not None:
        return first is not None and runtime.tensor_ordinal(first) is not None
    return getattr(getattr(first, "device", None), "type", None) == "cuda"


class CudaCopies:
    """What a worker adapter keeps for CUDA tensors, and its operations. Thread-safe."""

    device = "cuda"

    def __init__(
        self,
        client: Client,
        runtime: CudaRuntime,
        kv_caches: Mapping[str, Any],
        block_size: int,
        layout: str | None,
        failures: Failures,
        on_not_registered: Callable[[], None],
    ) -> None:
        self.client = client
        self.runtime = runtime
        self.failures = failures
        self._on_not_registered = on_not_registered
        self.layout, tensors = describe_cuda_caches(kv_caches, block_size, layout)
        ordinal = runtime.tensor_ordinal(tensors[0])
        if ordinal is None or any(runtime.tensor_ordinal(t) != ordinal for t in tensors):
            raise ValueError("all KV tensors must be on one GPU")
        self.ordinal = ordinal
        self.tensors = tensors  # kept alive: the server maps their memory
        self.cuda: CudaCache | None = CudaCache(
            device_uuid=runtime.device_uuids()[ordinal],
            layers=tuple(_wire(runtime.export_layer(t)) for t in tensors),
        )
        self._events = [runtime.new_event(ordinal) for _ in range(_EVENTS)]
        self._next = 0
        self._opened: dict[bytes, Event] = {}
        self._lock = threading.Lock()

    def engine_event(self) -> bytes:
        """Record an event on the calling thread's current stream (the engine's, right after
        its forward step); its IPC handle for the server."""
        with self._lock:
            event = self._events[self._next]
            self._next = (self._next + 1) % len(self._events)
        event.record(self.runtime.current_stream(self.ordinal))
        return event.ipc_handle()

    def attach(self, registered: Registered) -> None:
        """Nothing to map: the server copies into the engine's own memory."""

    def close(self) -> None:
        """Nothing mapped."""

    def wait(self, handle: bytes) -> None:
        """Block until the server's event ``handle`` has completed (its copies are done)."""
        with self._lock:
            event = self._opened.get(handle)
            if event is None:
                event = self._opened[handle] = self.runtime.open_event(self.ordinal, handle)
        event.synchronize()

    def block_ids(self, span: Span, keep_before: int) -> tuple[int, ...]:
        """The engine blocks of the span's chunks, -1 for those before token ``keep_before``
        (the engine has them already) and from ``span.stop_block`` on (a retrieve: the engine
        computes them; a store: the tail of the prompt's partial chunk, zeros in its slot)."""
        size = self.layout.block_size
        first, per = span.first * span.blocks_per_chunk, span.blocks_per_chunk
        return tuple(
            -1 if b * size < keep_before or b >= span.stop_block else int(span.block_ids[b])
            for b in range(first, first + span.chunks * per)
        )

    def store(self, span: Span, event: bytes) -> list[Future[Reply]]:
        """Send the blocks and the engine's event; wait for the server's event (the server
        commits the chunks itself). Raises what the store request raised.

        The prompt's partial chunk is stored as on the CPU path: its blocks, then -1 for the
        rest of the chunk, which the server's kernel fills with zeros."""
        request = span.store(block_ids=self.block_ids(span, 0), event=event)
        reply = self.client.call(request, StoreReply, fail_fast=True)
        count_failed_slots(self.failures, span.request_id, reply)
        if reply.done_event:
            self.wait(reply.done_event)
        return []

    def retrieve(self, span: Span, keep_before: int, event: bytes) -> Retrieved:
        """The server copies into the engine's blocks (-1: a block it leaves alone). In
        partial retrieves, as the arena path: the server queues the copies of the chunks in
        L1 while later ones still load; each part's chunks count as loaded once its event has
        completed."""
        blocks: Sequence[int] = self.block_ids(span, keep_before)
        per = span.blocks_per_chunk

        def part(start: int) -> Future[Reply]:
            request = span.retrieve(start, block_ids=tuple(blocks[start * per :]), event=event)
            return self.client.submit(request, fail_fast=True)

        result = Retrieved()
        start = 0
        future: Future[Reply] | None = part(0)
        while future is not None:
            try:
                reply = reply_of(future, RetrieveReply)
            except Exception as exc:
                cause = failure_cause(exc)
                result.causes.update((span.first + i, cause) for i in range(start, span.chunks))
                if isinstance(exc, NotRegistered):
                    self._on_not_registered()
                break
            future, rest = None, span.loading(reply)
            if rest is not None:  # asked for before waiting for this part's copies
                start, future = rest, part(rest)
            read = {slot.chunk for slot in reply.slots if slot.status == "read"}
            if read and reply.done_event:
                self.wait(reply.done_event)
                result.loaded |= read
        return result
