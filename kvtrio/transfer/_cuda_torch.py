"""The driver boundary implemented with torch: devices, kernels, CUDA IPC, pinned memory.

Only imported where a CUDA runtime is wanted (torch is imported lazily by :func:`torch_runtime`).
This is the code that cannot run without a GPU; it is kept to thin calls into torch so that
everything above it (:mod:`._cuda_engine`, the server's and the worker's CUDA paths) is tested
with a simulated device instead.

Kernels: the compiled extension (:mod:`._cuda_build`) when it builds (one launch per operation,
mapped or staged), else the fallback: torch index operations on the GPU into staging buffers
(two per layer per operation: correct, slower).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from ._batch import Operation
from ._cuda_build import extension_disabled, load_extension
from ._cuda_engine import IpcLayer
from ._geometry import geometry, kind_axes
from ._layouts import KVLayout

__all__ = ["TorchDevice", "TorchRuntime", "kernel_choice", "torch_runtime"]

log = logging.getLogger("kvtrio.cuda")

_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def kernel_choice(torch: Any, loader: Any = None) -> tuple[str, Any, str]:
    """Which kernels to use: ``("extension", module, "")`` or ``("torch", None, why)``.

    Never raises: a failed build is reported in ``why`` (and logged by the caller).
    """
    if extension_disabled():
        return "torch", None, "KVTRIO_NO_EXT is set"
    if not getattr(torch.version, "cuda", None):
        return "torch", None, "torch was built without CUDA"
    try:
        return "extension", load_extension(torch, loader), ""
    except Exception as exc:
        return "torch", None, f"building the CUDA extension failed: {exc}"


@attrs.define
class _Layers:
    layout: KVLayout
    tensors: list[Any]
    views: list[Any]
    """(kv, block, token, head, dim) views of each layer as same-size integers (fallback)."""
    geometry: Any = None
    """The geometry as a numpy int64 array (its address goes to the extension)."""
    bases: Any = None
    """The layers' addresses, in device memory (uploaded once)."""
    layer_bits: int = 0


_REGISTER_MAPPED = 3
"""cudaHostRegisterPortable | cudaHostRegisterMapped."""


def pin_memory(torch: Any, memory: Any) -> int:
    """Page-lock and map numpy ``memory`` (``cudaHostRegister``); returns its address."""
    cudart = torch.cuda.cudart()
    address = memory.__array_interface__["data"][0]
    error = cudart.cudaHostRegister(address, memory.nbytes, _REGISTER_MAPPED)
    if int(error) != 0:
        raise OSError(f"cudaHostRegister of {memory.nbytes} bytes failed: {error}")
    return int(address)


class TorchDevice:
    """A GPU through torch; ``extension`` is the compiled module or None (fallback).

    With the extension an operation is one call of ``extension.run`` with integers (addresses
    of the operation's numpy arrays, the stream's handle): no tensor is created per operation.
    The fallback copies with torch index operations into staging buffers (``staged`` only).
    """

    def __init__(self, torch: Any, ordinal: int, extension: Any) -> None:
        self.torch = torch
        self.ordinal = ordinal
        self.extension = extension
        self.kernels = "extension" if extension is not None else "torch"
        self.modes: tuple[str, ...] = ("mapped", "staged") if extension else ("staged",)
        self._device = torch.device("cuda", ordinal)

    def new_stream(self) -> Any:
        return self.torch.cuda.Stream(device=self._device)

    def new_event(self) -> Any:
        return self.torch.cuda.Event(interprocess=True)

    def open_event(self, handle: bytes) -> Any:
        return self.torch.cuda.Event.from_ipc_handle(self._device, handle)

    def new_buffer(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self._device)

    def buffer_address(self, buffer: Any) -> int:
        return int(buffer.data_ptr())

    def mapped_address(self, host_address: int) -> int:
        if self.extension is None:
            raise RuntimeError("mapped copies need the compiled extension")
        with self.torch.cuda.device(self.ordinal):
            return int(self.extension.device_pointer(host_address))

    def pin(self, memory: Any) -> Any:
        return pin_memory(self.torch, memory)

    def unpin(self, token: Any) -> None:
        self.torch.cuda.cudart().cudaHostUnregister(token)

    def prepare_layers(self, layout: KVLayout, tensors: Sequence[Any]) -> _Layers:
        torch = self.torch
        as_int = getattr(torch, _INT_OF_SIZE[layout.element_size])
        axes = kind_axes(layout.kind)  # (kv, block, token, head, dim) → tensor axis
        views = []
        for tensor in tensors:
            raw = tensor.view(as_int)
            views.append(raw[None, :, :, None, :] if layout.kind == "mla" else raw.permute(*axes))
        prepared = _Layers(layout, list(tensors), views)
        strides = {tuple(t.stride()) for t in tensors}
        if self.extension is not None:
            if len(strides) != 1:
                raise ValueError("all layers must have the same strides")
            prepared.geometry = np.array(geometry(layout, strides.pop()), np.int64)
            addresses = [t.data_ptr() for t in tensors]
            prepared.bases = torch.tensor(addresses, dtype=torch.int64, device=self._device)
            for address in addresses:
                prepared.layer_bits |= address
        return prepared

    def run(
        self,
        layers: _Layers,
        op: Operation,
        segments: npt.NDArray[np.void],
        staging: Any,
        *,
        gather: bool,
        stream: Any,
    ) -> None:
        if self.extension is not None:
            ids = op.ids
            self.extension.run(
                self.ordinal, layers.geometry.ctypes.data, layers.layer_bits,
                len(layers.tensors), layers.bases.data_ptr(), ids.ctypes.data, len(ids),
                segments.ctypes.data, len(segments), gather, stream.cuda_stream,
            )  # fmt: skip
            return
        with self._on(stream):
            if len({row[3] for row in op.rows}) == 1:
                self._fallback(layers, op.ids, op.chunks, staging, gather=gather, stream=stream)
                return
            position = 0  # chunks of different sizes: one at a time
            for _offset, nbytes, first, count in op.rows:
                part = staging[position : position + nbytes]
                ids = op.ids[first : first + count]
                self._fallback(layers, ids, 1, part, gather=gather, stream=stream)
                position += nbytes

    def _on(self, stream: Any) -> Any:
        """The context that makes ``stream`` current for torch's operations."""
        return self.torch.cuda.stream(stream)

    def _upload(self, ids: npt.NDArray[Any]) -> Any:
        torch = self.torch
        host = torch.from_numpy(ids.astype(np.int64)).pin_memory()
        return host.to(self._device, non_blocking=True)

    def _fallback(
        self, layers: _Layers, ids: npt.NDArray[Any], n: int, staging: Any, *, gather: bool,
        stream: Any,
    ) -> None:  # fmt: skip
        """``n`` chunks of equal size, packed in ``staging``: two torch operations per layer
        (an index and a strided copy), one where ``n`` is 1. Block id -1: a gather writes zeros
        for it (one more operation per layer), a scatter leaves that engine block alone."""
        layout = layers.layout
        per = len(ids) // n
        tail = (layout.block_size, layout.num_heads, layout.head_dim)
        nbytes = n * layout.num_layers * layout.kv * per * layout.block_size * layout.num_heads \
            * layout.head_dim * layout.element_size  # fmt: skip
        chunks = staging[:nbytes].view(layers.views[0].dtype)
        chunks = chunks.view(n, layout.num_layers, layout.kv, per, *tail)
        if gather:
            skipped = np.flatnonzero(ids < 0)  # -1: no engine block, zeros in the chunk
            device_ids = self._upload(np.where(ids < 0, 0, ids) if len(skipped) else ids)
            zeros = self._upload(skipped) if len(skipped) else None
            for layer, view in enumerate(layers.views):
                if n == 1:
                    self.torch.index_select(view, 1, device_ids, out=chunks[0, layer])
                    if zeros is not None:
                        chunks[0, layer].index_fill_(1, zeros, 0)
                    continue
                picked = view.index_select(1, device_ids)
                if zeros is not None:
                    picked.index_fill_(1, zeros, 0)
                chunks[:, layer].copy_(picked.view(layout.kv, n, per, *tail).transpose(0, 1))
            return
        keep = np.flatnonzero(ids >= 0)  # -1: a block the engine keeps
        device_ids = self._upload(ids[keep])
        positions = self._upload(keep) if len(keep) < len(ids) else None
        for layer, view in enumerate(layers.views):
            source = chunks[0, layer] if n == 1 else chunks[:, layer].transpose(0, 1).reshape(
                layout.kv, n * per, *tail
            )  # fmt: skip
            if positions is not None:
                source = source.index_select(1, positions)
            view.index_copy_(1, device_ids, source)

    def to_host(self, host: Any, buffer: Any, offset: int, stream: Any) -> None:
        torch = self.torch
        with torch.cuda.stream(stream):
            target = torch.from_numpy(host)
            target.copy_(buffer[offset : offset + host.nbytes], non_blocking=True)

    def to_device(self, buffer: Any, offset: int, host: Any, stream: Any) -> None:
        torch = self.torch
        with torch.cuda.stream(stream):
            source = torch.from_numpy(host)
            buffer[offset : offset + host.nbytes].copy_(source, non_blocking=True)


class TorchRuntime:
    """CUDA through torch. Devices are created on first use, with the kernels chosen once."""

    def __init__(self, torch: Any, loader: Any = None) -> None:
        self.torch = torch
        self._loader = loader
        self._devices: dict[int, TorchDevice] = {}
        self._kernels: tuple[str, Any, str] | None = None
        self._lock = threading.Lock()

    def device_uuids(self) -> list[str]:
        cuda = self.torch.cuda
        return [str(cuda.get_device_properties(i).uuid) for i in range(cuda.device_count())]

    def device(self, ordinal: int) -> TorchDevice:
        with self._lock:
            if self._kernels is None:
                self._kernels = kernel_choice(self.torch, self._loader)
                if self._kernels[0] != "extension":
                    log.warning("kvtrio CUDA copies use the pure-torch fallback: %s",
                                self._kernels[2])  # fmt: skip
            if ordinal not in self._devices:
                self._devices[ordinal] = TorchDevice(self.torch, ordinal, self._kernels[1])
            return self._devices[ordinal]

    def tensor_ordinal(self, tensor: Any) -> int | None:
        device: Any = getattr(tensor, "device", None)  # None: not a tensor (a numpy array)
        if device is None or device.type != "cuda":
            return None
        return int(device.index if device.index is not None else self.torch.cuda.current_device())

    def export_layer(self, tensor: Any) -> IpcLayer:
        (_device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
            tensor.untyped_storage()._share_cuda_()
        )
        return IpcLayer(
            handle=bytes(handle),
            storage_size=int(size),
            storage_offset=int(offset),
            ref_counter_handle=bytes(ref_handle),
            ref_counter_offset=int(ref_offset),
            event_handle=bytes(event_handle or b""),
            event_sync_required=bool(event_sync),
            shape=tuple(int(n) for n in tensor.shape),
            stride=tuple(int(s) for s in tensor.stride()),
            offset=int(tensor.storage_offset()),
            dtype=str(tensor.dtype).removeprefix("torch."),
        )

    def open_layer(self, ordinal: int, layer: IpcLayer) -> Any:
        torch = self.torch
        storage = torch.UntypedStorage._new_shared_cuda(
            ordinal,
            layer.handle,
            layer.storage_size,
            layer.storage_offset,
            layer.ref_counter_handle,
            layer.ref_counter_offset,
            layer.event_handle or None,
            layer.event_sync_required,
        )
        dtype = getattr(torch, layer.dtype)
        tensor = torch.empty((0,), dtype=dtype, device=torch.device("cuda", ordinal))
        return tensor.set_(storage, layer.offset, layer.shape, layer.stride)

    def close_layer(self, tensor: Any) -> None:
        # torch closes the IPC mapping when the last reference to the storage goes.
        del tensor

    def current_stream(self, ordinal: int) -> Any:
        return self.torch.cuda.current_stream(ordinal)

    def new_event(self, ordinal: int) -> Any:
        with self.torch.cuda.device(ordinal):
            return self.torch.cuda.Event(interprocess=True)

    def open_event(self, ordinal: int, handle: bytes) -> Any:
        return self.torch.cuda.Event.from_ipc_handle(self.torch.device("cuda", ordinal), handle)

    def pin(self, memory: Any) -> Any:
        return pin_memory(self.torch, memory)

    def unpin(self, token: Any) -> None:
        self.torch.cuda.cudart().cudaHostUnregister(token)


def torch_runtime() -> TorchRuntime | None:
    """A runtime if torch has CUDA and sees a GPU, else None (imports torch; blocking)."""
    try:
        import torch
    except ImportError:
        return None
    if not getattr(torch.version, "cuda", None) or not torch.cuda.is_available():
        return None
    return TorchRuntime(torch)
