"""The CUDA worker's side: export the KV cache by IPC, hand the server events, wait for its.

With CUDA tensors the server copies (``docs/gpu.md``): this helper of :class:`WorkerAdapter`
describes the layers (IPC handles, shape/stride/offset/dtype, the GPU's UUID), records an
interprocess event on the engine's current stream when an operation is submitted (after the
forward step the engine queued), and, once the server answers, waits for the server's event,
so that a future is done only when the bytes are in place.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..protocol import CudaCache, CudaLayer
from ..transfer.cuda import CudaRuntime, Event, IpcLayer
from ._tensors import describe_cuda_caches

__all__ = ["CudaWorker", "is_cuda_cache"]

_EVENTS = 16
"""Interprocess events used in turn for the engine side of operations. Reusing one early only
makes the server wait longer (for a later forward step), never less."""


def _wire(layer: IpcLayer) -> CudaLayer:
    """A layer as the ``register`` message carries it (the same fields)."""
    return CudaLayer(**attrs.asdict(layer, recurse=False))


def is_cuda_cache(kv_caches: Mapping[str, Any]) -> bool:
    """Whether the engine's KV tensors are CUDA tensors (without importing torch)."""
    first = next(iter(kv_caches.values()), None)
    device = getattr(first, "device", None)
    return getattr(device, "type", None) == "cuda" or type(first).__name__ == "FakeTensor"


class CudaWorker:
    """What a :class:`WorkerAdapter` keeps for CUDA tensors. Thread-safe."""

    def __init__(
        self,
        runtime: CudaRuntime,
        kv_caches: Mapping[str, Any],
        block_size: int,
        layout: str | None,
    ) -> None:
        self.runtime = runtime
        self.layout, tensors = describe_cuda_caches(kv_caches, block_size, layout)
        ordinal = runtime.tensor_ordinal(tensors[0])
        if ordinal is None or any(runtime.tensor_ordinal(t) != ordinal for t in tensors):
            raise ValueError("all KV tensors must be on one GPU")
        self.ordinal = ordinal
        self.tensors = tensors  # kept alive: the server maps their memory
        self.cache = CudaCache(
            device_uuid=runtime.device_uuids()[ordinal],
            layers=tuple(_wire(runtime.export_layer(t)) for t in tensors),
        )
        self._events = [runtime.new_event(ordinal) for _ in range(_EVENTS)]
        self._next = 0
        self._opened: dict[bytes, Event] = {}
        self._lock = threading.Lock()

    def record(self) -> bytes:
        """Record an event on the calling thread's current stream (the engine's, right after
        its forward step); its IPC handle for the server."""
        with self._lock:
            event = self._events[self._next]
            self._next = (self._next + 1) % len(self._events)
        event.record(self.runtime.current_stream(self.ordinal))
        return event.ipc_handle()

    def wait(self, handle: bytes) -> None:
        """Block until the server's event ``handle`` has completed (its copies are done)."""
        with self._lock:
            event = self._opened.get(handle)
            if event is None:
                event = self._opened[handle] = self.runtime.open_event(self.ordinal, handle)
        event.synchronize()

    def block_ids(
        self, op_block_ids: Sequence[int], start: int, end: int, chunk_size: int, keep_before: int
    ) -> tuple[int, ...]:
        """The engine blocks of the full chunks of ``[start, end)``, -1 for those before token
        ``keep_before`` (the engine has them already)."""
        size = self.layout.block_size
        first, last = start // size, (end // chunk_size) * chunk_size // size
        return tuple(
            -1 if b * size < keep_before else int(op_block_ids[b]) for b in range(first, last)
        )
