"""A simulated CUDA runtime: the driver boundary faked, everything above it real.

:class:`FakeCuda` implements :class:`kvtrio.transfer.cuda.CudaRuntime` over host memory:

* **GPUs** with UUIDs; :meth:`FakeCuda.process_view` gives another process's view of the same
  GPUs in another ``CUDA_VISIBLE_DEVICES`` order (ordinals differ, UUIDs do not);
* **device memory** and **IPC**: :meth:`FakeCuda.empty` allocates a "CUDA tensor"
  (:class:`FakeTensor`, a numpy array underneath); ``export_layer`` / ``open_layer`` share it by
  handle, as CUDA IPC does, and count what is open;
* **streams and events** with CUDA's ordering rules: work queued on a stream runs in order; a
  stream that waits for an event stalls until the event's latest record (at the time of the
  wait) has been reached; :meth:`FakeCuda.hold` stalls a stream (an engine busy with its forward
  step) until :meth:`FakeCuda.release`;
* **kernels**: the host build of the real operation kernel (:meth:`HostLibrary.run`), called
  with the very descriptors the real launch gets; "device addresses" of pinned host memory are
  its host addresses (as with UVA), and a mapped segment outside pinned memory is an error.

Work runs in whichever thread unblocks it; ``synchronize`` waits on a condition (bounded).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from ..transfer import DTYPE_SIZES, KVLayout
from ..transfer.cuda import HostLibrary, IpcLayer, Operation, geometry

__all__ = ["FakeCuda", "FakeEvent", "FakeStream", "FakeTensor"]

Array = npt.NDArray[Any]
_NUMPY_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_SYNC_TIMEOUT = 30.0


@attrs.define(eq=False)
class FakeTensor:
    """A "CUDA tensor": ``array`` is its memory, on GPU ``uuid``."""

    array: Array
    dtype: str
    uuid: str
    allocation: bytes
    """IPC handle of the allocation it lives in."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


class _Gpu:
    """State shared by every process view: allocations, events, streams, the lock."""

    def __init__(self, host_library: HostLibrary) -> None:
        self.cond = threading.Condition(threading.RLock())
        self.host_library = host_library
        self.allocations: dict[bytes, tuple[str, Array]] = {}
        self.events: dict[bytes, FakeEvent] = {}
        self.streams: list[FakeStream] = []
        self.open_layers = 0
        self.opened_total = 0
        self.kernels = 0
        self.pinned: dict[int, int] = {}
        """Page-locked host ranges (address → bytes), by runtimes and devices alike."""

    def pump(self) -> None:
        """Run whatever work can run now (under the lock)."""
        with self.cond:
            progress = True
            while progress:
                progress = False
                for stream in self.streams:
                    while stream.queue and not stream.held:
                        op = stream.queue[0]
                        if isinstance(op, tuple):
                            event, target = op
                            if event.completed < target:
                                break
                            stream.queue.popleft()
                        else:
                            stream.queue.popleft()
                            op()
                        progress = True
            self.cond.notify_all()


class FakeStream:
    def __init__(self, gpu: _Gpu, ordinal: int) -> None:
        self.gpu = gpu
        self.ordinal = ordinal
        self.queue: collections.deque[Callable[[], None] | tuple[FakeEvent, int]] = (
            collections.deque()
        )
        self.held = False
        with gpu.cond:
            gpu.streams.append(self)

    def enqueue(self, work: Callable[[], None]) -> None:
        with self.gpu.cond:
            self.queue.append(work)
            self.gpu.pump()

    def wait_event(self, event: FakeEvent) -> None:
        with self.gpu.cond:
            self.queue.append((event, event.recorded))
            self.gpu.pump()

    @property
    def idle(self) -> bool:
        return not self.queue


class FakeEvent:
    def __init__(self, gpu: _Gpu, handle: bytes) -> None:
        self.gpu = gpu
        self.handle = handle
        self.recorded = 0
        self.completed = 0

    def record(self, stream: FakeStream | None = None) -> None:
        assert stream is not None, "the fake needs an explicit stream"
        with self.gpu.cond:
            self.recorded += 1
            target = self.recorded

            def reached() -> None:
                self.completed = max(self.completed, target)

            stream.enqueue(reached)

    def query(self) -> bool:
        with self.gpu.cond:
            return self.completed >= self.recorded

    def synchronize(self) -> None:
        with self.gpu.cond:
            if not self.gpu.cond.wait_for(self.query, _SYNC_TIMEOUT):
                raise TimeoutError("fake CUDA event never completed (a stream held forever?)")

    def ipc_handle(self) -> bytes:
        return self.handle


class FakeDevice:
    """One simulated GPU (see :class:`FakeCuda`); its kernels run the host library."""

    kernels = "host"
    modes = ("mapped", "staged")

    def __init__(self, gpu: _Gpu, ordinal: int) -> None:
        self.gpu = gpu
        self.ordinal = ordinal
        self.default_stream = FakeStream(gpu, ordinal)

    def new_stream(self) -> FakeStream:
        return FakeStream(self.gpu, self.ordinal)

    def new_event(self) -> FakeEvent:
        handle = os.urandom(64)
        event = FakeEvent(self.gpu, handle)
        with self.gpu.cond:
            self.gpu.events[handle] = event
        return event

    def open_event(self, handle: bytes) -> FakeEvent:
        with self.gpu.cond:
            event = self.gpu.events.get(handle)
        if event is None:
            raise RuntimeError("cudaIpcOpenEventHandle: invalid resource handle")
        return event

    def new_buffer(self, nbytes: int) -> Array:
        return np.zeros(nbytes, np.uint8)

    def buffer_address(self, buffer: Array) -> int:
        return int(buffer.ctypes.data)

    def mapped_address(self, host_address: int) -> int:
        """The "device address" of pinned host memory: the host address itself (as with UVA);
        refused for memory that was not pinned, as cudaHostGetDevicePointer does."""
        with self.gpu.cond:
            if host_address not in self.gpu.pinned:
                raise RuntimeError("cudaHostGetDevicePointer: invalid argument (not pinned)")
        return host_address

    def pin(self, memory: Array) -> Any:
        token = memory.__array_interface__["data"][0]
        with self.gpu.cond:
            self.gpu.pinned[token] = memory.nbytes
        return token

    def unpin(self, token: Any) -> None:
        with self.gpu.cond:
            del self.gpu.pinned[token]

    def prepare_layers(self, layout: KVLayout, tensors: Sequence[Any]) -> Any:
        arrays = [t.array if isinstance(t, FakeTensor) else t for t in tensors]
        strides = {a.strides for a in arrays}
        assert len(strides) == 1, "layers with different strides"
        element = layout.element_size
        g = geometry(layout, [s // element for s in strides.pop()])
        return g, [a.__array_interface__["data"][0] for a in arrays], arrays

    def run(
        self,
        layers: Any,
        op: Operation,
        segments: npt.NDArray[np.void],
        staging: Any,
        *,
        gather: bool,
        stream: FakeStream,
    ) -> None:
        g, bases, _arrays = layers
        ids, segments = op.ids.copy(), segments.copy()  # a launch copies its parameter
        if staging is None:  # mapped: every segment must lie in pinned host memory
            with self.gpu.cond:
                pinned = list(self.gpu.pinned.items())
            for address, length in zip(segments["address"].tolist(), segments["length"].tolist(),
                                       strict=True):  # fmt: skip
                assert any(a <= address and address + length <= a + n for a, n in pinned), (
                    "a mapped segment outside pinned memory"
                )

        def launch() -> None:
            self.gpu.kernels += 1
            self.gpu.host_library.run(g, bases, ids, segments, gather=gather)

        stream.enqueue(launch)

    def to_host(self, host: Array, buffer: Array, offset: int, stream: FakeStream) -> None:
        def copy() -> None:
            host[...] = buffer[offset : offset + host.nbytes]

        stream.enqueue(copy)

    def to_device(self, buffer: Array, offset: int, host: Array, stream: FakeStream) -> None:
        def copy() -> None:
            buffer[offset : offset + host.nbytes] = host

        stream.enqueue(copy)


class FakeCuda:
    """A simulated CUDA runtime (see the module docstring). ``uuids`` by this view's ordinal."""

    def __init__(
        self, host_library: HostLibrary, uuids: Sequence[str] = ("GPU-fake-0",), *, _gpu: Any = None
    ) -> None:
        self.gpu: _Gpu = _gpu if _gpu is not None else _Gpu(host_library)
        self.uuids = list(uuids)
        self._devices: dict[int, FakeDevice] = {}
        self.fail_pin: str | None = None

    def process_view(self, uuids: Sequence[str]) -> FakeCuda:
        """Another process's runtime over the same GPUs, seeing ``uuids`` in that order."""
        return FakeCuda(self.gpu.host_library, uuids, _gpu=self.gpu)

    # ----------------------------------------------------------------- CudaRuntime

    def device_uuids(self) -> list[str]:
        return list(self.uuids)

    def device(self, ordinal: int) -> FakeDevice:
        if ordinal not in self._devices:
            self._devices[ordinal] = FakeDevice(self.gpu, ordinal)
        return self._devices[ordinal]

    def tensor_ordinal(self, tensor: Any) -> int | None:
        return self.uuids.index(tensor.uuid) if isinstance(tensor, FakeTensor) else None

    def export_layer(self, tensor: FakeTensor) -> IpcLayer:
        with self.gpu.cond:
            _uuid, allocation = self.gpu.allocations[tensor.allocation]
        start = tensor.array.__array_interface__["data"][0] - allocation.ctypes.data
        element = DTYPE_SIZES[tensor.dtype]
        return IpcLayer(
            handle=tensor.allocation,
            storage_size=allocation.nbytes - start,
            storage_offset=start,
            ref_counter_handle=b"/fake-refcount",
            ref_counter_offset=0,
            event_handle=b"",
            event_sync_required=False,
            shape=tensor.shape,
            stride=tuple(s // element for s in tensor.array.strides),
            offset=0,
            dtype=tensor.dtype,
        )

    def open_layer(self, ordinal: int, layer: IpcLayer) -> FakeTensor:
        with self.gpu.cond:
            found = self.gpu.allocations.get(layer.handle)
            if found is None:
                raise RuntimeError("cudaIpcOpenMemHandle: invalid argument")
            uuid, allocation = found
            if self.uuids[ordinal] != uuid:
                raise RuntimeError("cudaIpcOpenMemHandle: the handle is of another device")
            self.gpu.open_layers += 1
            self.gpu.opened_total += 1
        element = DTYPE_SIZES[layer.dtype]
        start = layer.storage_offset + layer.offset * element
        array = np.lib.stride_tricks.as_strided(
            allocation[start:].view(_NUMPY_OF_SIZE[element]),
            shape=layer.shape,
            strides=tuple(s * element for s in layer.stride),
        )
        return FakeTensor(array, layer.dtype, uuid, layer.handle)

    def close_layer(self, tensor: FakeTensor) -> None:
        with self.gpu.cond:
            self.gpu.open_layers -= 1

    def current_stream(self, ordinal: int) -> FakeStream:
        return self.device(ordinal).default_stream

    def new_event(self, ordinal: int) -> FakeEvent:
        return self.device(ordinal).new_event()

    def open_event(self, ordinal: int, handle: bytes) -> FakeEvent:
        return self.device(ordinal).open_event(handle)

    def pin(self, memory: Array) -> Any:
        if self.fail_pin is not None:
            raise OSError(self.fail_pin)
        return self.device(0).pin(memory)

    def unpin(self, token: Any) -> None:
        self.device(0).unpin(token)

    @property
    def pinned(self) -> dict[int, int]:
        """Page-locked host ranges (address → bytes)."""
        return self.gpu.pinned

    # ----------------------------------------------------------------- test controls

    def empty(self, shape: Sequence[int], dtype: str, ordinal: int = 0, pad: int = 0) -> FakeTensor:
        """A new "CUDA tensor" on GPU ``ordinal`` (with ``pad`` spare bytes before it, so that
        its storage does not start at its allocation), filled with zeros."""
        element = DTYPE_SIZES[dtype]
        nbytes = int(np.prod(shape)) * element
        allocation = np.zeros(nbytes + pad, np.uint8)
        handle = os.urandom(64)
        with self.gpu.cond:
            self.gpu.allocations[handle] = (self.uuids[ordinal], allocation)
        array = allocation[pad:].view(_NUMPY_OF_SIZE[element]).reshape(shape)
        return FakeTensor(array, dtype, self.uuids[ordinal], handle)

    def hold(self, stream: FakeStream) -> None:
        """Stall a stream (its queued work waits) until :meth:`release`."""
        with self.gpu.cond:
            stream.held = True

    def release(self, stream: FakeStream) -> None:
        with self.gpu.cond:
            stream.held = False
            self.gpu.pump()

    def on_stream(self, stream: FakeStream, work: Callable[[], None]) -> None:
        """Queue host work on a stream (an engine's forward step writing its KV cache)."""
        stream.enqueue(work)

    @property
    def open_layers(self) -> int:
        """Layers opened by ``open_layer`` and not closed yet (all views)."""
        return self.gpu.open_layers
