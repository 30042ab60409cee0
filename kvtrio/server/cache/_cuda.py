"""Server-driven transfers for CUDA workers: IPC registrations, queued copies, completions.

A CUDA worker registers its layers by CUDA IPC; :meth:`CudaTransfers.open` maps the GPU's UUID
to this process's ordinal, checks every layer against the layout, opens the handles (once per
registration) and prepares the device's :class:`~kvtrio.transfer.cuda.CopyPipeline`. The first
CUDA registration also creates the runtime (imports torch: a server that never sees one never
does); the first CUDA registration of each tenant pins (and maps) that tenant's L1 arena, so
CUDA workers are served in every tenant's arena.

Stores and retrieves only *queue* work (kernel launches and asynchronous copies: nothing waits
for the GPU in the event loop) and return the IPC handle of the operation's ``done`` event. The
watcher task (:meth:`CudaTransfers.serve`) waits for those events in order, in a worker thread,
and runs each operation's completion: a store's chunks are committed only then, a retrieve's
pins released only then. Requests that read the cache first run the completions whose events
have already finished (:meth:`CudaTransfers.settle`, non-blocking queries), so a chunk whose
store the worker has seen done is never missed by the lookup that follows. Closing a
registration is queued behind its work the same way, so an IPC mapping is never closed under a
copy. The queue is a deque, not a bounded channel: every
entry holds L1 reservations or pins, so L1's capacity bounds it.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from ...errors import ErrorCode, RequestError
from ...protocol import CudaCache, CudaLayer
from ...shm import SharedArena
from ...transfer import KVLayout
from ...transfer.cuda import (
    CopyPipeline,
    CudaRuntime,
    Event,
    IpcLayer,
    Operation,
    PinnedHost,
    check_extent,
)

__all__ = ["CudaRegistration", "CudaTransfers", "RuntimeFactory"]

log = logging.getLogger("kvtrio.cuda")

RuntimeFactory = Callable[[], CudaRuntime | None]
"""Creates the process's CUDA runtime, or None without a usable GPU (blocking)."""

_EVENTS_PER_REGISTRATION = 8


def _default_runtime() -> CudaRuntime | None:
    from ...transfer.cuda import torch_runtime

    return torch_runtime()


def bad_request(message: str) -> RequestError:
    return RequestError(ErrorCode.BAD_REQUEST, message)


@attrs.define(eq=False)
class CudaRegistration:
    """A CUDA worker's opened layers and what its operations use."""

    ordinal: int
    layout: KVLayout
    tensors: list[Any]
    prepared: Any
    pipeline: CopyPipeline
    host: PinnedHost
    """The tenant's L1 arena, pinned (the slots' offsets are into it)."""
    events: list[Event]
    """The server's done events, used in turn (an adapter that waits on a reused one only waits
    longer, never less)."""
    engine_events: dict[bytes, Event] = attrs.field(factory=dict)
    next_event: int = 0
    closed: bool = False

    def done_event(self) -> Event:
        event = self.events[self.next_event]
        self.next_event = (self.next_event + 1) % len(self.events)
        return event


@attrs.define(eq=False)
class _Pending:
    event: Event | None
    complete: Callable[[bool], None] | None = None
    close: Callable[[], None] | None = None


class CudaTransfers:
    """The CUDA side of the cache service (one per server)."""

    def __init__(self, runtime: RuntimeFactory | None = None) -> None:
        self._factory = runtime or _default_runtime
        self._limiter = trio.CapacityLimiter(1)
        """Blocking CUDA calls of the server (opening handles, pinning, building kernels)."""
        self.runtime: CudaRuntime | None = None
        self.pinned: dict[str, PinnedHost] = {}
        """Each tenant arena with a CUDA registration, pinned (by its file's path)."""
        self._pipelines: dict[tuple[int, int], CopyPipeline] = {}
        self._pending: collections.deque[_Pending] = collections.deque()
        self._wakeup = trio.lowlevel.ParkingLot()
        self.wait_limiter = trio.CapacityLimiter(1)
        """The watcher's wait for the next completion (one at a time, in order). Per instance:
        a stopped server's abandoned wait (its GPU work never finished) must not hold up
        another server's watcher in the same process (tests run many)."""
        self.registrations = 0
        self.operations = 0
        self.failures = 0

    # ----------------------------------------------------------------- registration

    async def open(
        self, spec: CudaCache | None, layout: KVLayout, chunk_bytes: int, arena: SharedArena
    ) -> CudaRegistration:
        """Validate and open a CUDA registration whose slots are in ``arena`` (its tenant's);
        ``RequestError`` says what is wrong.

        Cancellation: the blocking part finishes; what it opened is closed again.
        """
        if spec is None:
            raise bad_request("device 'cuda' needs the 'cuda' field (the layers' IPC handles)")
        self._check_layers(spec.layers, layout)
        runtime = await self._runtime()
        host = await self._pin(runtime, arena)
        uuids = runtime.device_uuids()
        if spec.device_uuid not in uuids:
            raise bad_request(
                f"GPU {spec.device_uuid} is not visible to the kvtrio server (it sees "
                f"{', '.join(uuids) or 'no GPU'}): run the server where it can see the engine's "
                "GPUs (same host, same CUDA_VISIBLE_DEVICES set or a superset)"
            )
        ordinal = uuids.index(spec.device_uuid)

        def open_all() -> CudaRegistration:
            device = runtime.device(ordinal)
            tensors: list[Any] = []
            try:
                for layer in spec.layers:
                    ipc = IpcLayer(**attrs.asdict(layer, recurse=False))  # wire → transfer
                    tensors.append(runtime.open_layer(ordinal, ipc))
                key = (ordinal, chunk_bytes)
                if key not in self._pipelines:
                    self._pipelines[key] = CopyPipeline(device, chunk_bytes)
                if self._pipelines[key].mode == "mapped":
                    host.map(ordinal, device.mapped_address)  # once per arena and GPU
                prepared = device.prepare_layers(layout, tensors)
                events = [device.new_event() for _ in range(_EVENTS_PER_REGISTRATION)]
            except BaseException:
                for tensor in tensors:
                    runtime.close_layer(tensor)
                raise
            return CudaRegistration(
                ordinal, layout, tensors, prepared, self._pipelines[key], host, events
            )

        with trio.CancelScope(shield=True):
            try:
                registration = await trio.to_thread.run_sync(open_all, limiter=self._limiter)
            except RequestError:
                raise
            except Exception as exc:
                raise bad_request(f"cannot open the KV cache's CUDA IPC handles: {exc}") from None
        self.registrations += 1
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            self.close(registration)
            raise
        return registration

    def _check_layers(self, layers: Sequence[CudaLayer], layout: KVLayout) -> None:
        if len(layers) != layout.num_layers:
            raise bad_request(f"{len(layers)} CUDA layers for a layout of {layout.num_layers}")
        strides = {tuple(layer.stride) for layer in layers}
        if len(strides) != 1:
            raise bad_request("all layers must have the same strides")
        for i, layer in enumerate(layers):
            if layer.dtype != layout.dtype:
                raise bad_request(f"layer {i}: dtype {layer.dtype}, the layout says {layout.dtype}")
            if tuple(layer.shape) != layout.layer_shape:
                raise bad_request(
                    f"layer {i}: shape {tuple(layer.shape)}, a {layout.kind} layout has "
                    f"{layout.layer_shape}"
                )
            if layer.storage_size < 0 or layer.storage_offset < 0:
                raise bad_request(f"layer {i}: negative storage size or offset")
            try:
                check_extent(layout, layer.stride, layer.offset, layer.storage_size, f"layer {i}")
            except ValueError as exc:
                raise bad_request(str(exc)) from None

    async def _runtime(self) -> CudaRuntime:
        if self.runtime is not None:
            return self.runtime
        runtime = await trio.to_thread.run_sync(self._factory, limiter=self._limiter)
        if runtime is None:
            raise bad_request(
                "this kvtrio server has no usable CUDA (it needs torch built with CUDA and a "
                "visible GPU): start it on the GPU host, in an environment with torch"
            )
        if self.runtime is None:
            self.runtime = runtime
        return self.runtime

    async def _pin(self, runtime: CudaRuntime, arena: SharedArena) -> PinnedHost:
        """The tenant arena, pinned at its first CUDA registration (blocking part in a thread).

        Cancellation: the pinning finishes and is kept for the next registration."""
        found = self.pinned.get(arena.path)
        if found is not None:
            return found
        with trio.CancelScope(shield=True):
            try:
                pinned: PinnedHost = await trio.to_thread.run_sync(
                    PinnedHost, runtime, arena.buffer, limiter=self._limiter
                )
            except Exception as exc:
                raise bad_request(
                    f"cannot pin the L1 arena for GPU copies ({exc}): raise the locked-memory "
                    "limit (ulimit -l unlimited; in a container: --ulimit memlock=-1) or lower "
                    "--l1-size"
                ) from None
        if arena.path in self.pinned:  # another registration pinned it meanwhile
            pinned.close()
            return self.pinned[arena.path]
        self.pinned[arena.path] = pinned
        log.info("CUDA transfers ready for an L1 arena: pinned in %d pieces",
                 -(-arena.size // pinned.piece_bytes))  # fmt: skip
        return pinned

    def close(self, registration: CudaRegistration) -> None:
        """Close a registration's IPC handles once the work queued before now is done."""
        if registration.closed:
            return
        registration.closed = True
        runtime = self.runtime
        assert runtime is not None

        def close() -> None:
            for tensor in registration.tensors:
                runtime.close_layer(tensor)
            registration.tensors.clear()

        self._queue(_Pending(None, close=close))

    # ----------------------------------------------------------------- operations

    def _event(self, registration: CudaRegistration, handle: bytes) -> Event | None:
        if not handle:
            return None
        event = registration.engine_events.get(handle)
        if event is None:
            try:
                event = registration.pipeline.device.open_event(handle)
            except Exception as exc:
                raise bad_request(f"cannot open the engine's CUDA event: {exc}") from None
            registration.engine_events[handle] = event
        return event

    def submit(
        self,
        registration: CudaRegistration,
        chunks: Sequence[tuple[Sequence[int], int, int]],
        engine_event: bytes,
        complete: Callable[[bool], None],
        *,
        store: bool,
    ) -> bytes:
        """Queue a store (engine → L1) or retrieve of ``chunks`` (block ids, slot offset, slot
        bytes); ``complete(ok)`` runs once the copies are done. Returns the done event's handle.

        ``RequestError`` before anything is queued if an argument is wrong; ``complete(False)``
        runs (later) if queueing fails halfway.
        """
        assert not registration.closed
        after = self._event(registration, engine_event)
        op = Operation.of(chunks)
        done = registration.done_event()
        pipeline, host = registration.pipeline, registration.host
        self.operations += 1
        try:
            if store:
                pipeline.store(registration.prepared, op, host, after, done)
            else:
                pipeline.retrieve(registration.prepared, op, host, after, done)
        except Exception:
            log.exception("queueing CUDA copies failed")
            self.failures += 1
            self._queue(_Pending(None, complete=complete))  # after what is already queued
            return b""
        self._queue(_Pending(done, complete=complete))
        return done.ipc_handle()

    def settle(self) -> None:
        """Run now, in order, the completions whose copies have already finished.

        A worker's operation is done when it sees the server's done event complete, and its
        next request (a lookup of what it stored) can reach the server before :meth:`serve`'s
        thread wait has returned: the request would miss a chunk that is in L1. Requests that
        read the cache call this first, so "done" at the worker means "visible" at the server.
        Only non-blocking event queries; an item that needs a thread (a close) or whose query
        fails stops it, and :meth:`serve` handles the rest.
        """
        while self._pending:
            item = self._pending[0]
            if item.event is None or item.close is not None:
                return
            try:
                if not item.event.query():
                    return
            except Exception:
                return  # a failed copy: serve() logs and counts it
            self._pending.popleft()
            if item.complete is not None:
                item.complete(True)

    def _queue(self, pending: _Pending) -> None:
        self._pending.append(pending)
        self._wakeup.unpark_all()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run completions in order as their events complete; never returns.

        Cancellation: a wait in progress is abandoned (the GPU may still be copying; the
        server is stopping).
        """
        task_status.started()
        while True:
            while not self._pending:
                await self._wakeup.park()
            item = self._pending[0]
            ok = True
            if item.event is not None:
                try:
                    await trio.to_thread.run_sync(
                        item.event.synchronize, limiter=self.wait_limiter, abandon_on_cancel=True
                    )
                except Exception:
                    log.exception("a CUDA copy failed")
                    self.failures += 1
                    ok = False
            if not self._pending or self._pending[0] is not item:
                continue  # settle() completed it while the thread waited
            if item.close is not None:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(item.close, limiter=self._limiter)
            self._pending.popleft()
            if item.complete is not None:
                item.complete(ok and item.event is not None)

    @property
    def pending(self) -> int:
        return len(self._pending)
