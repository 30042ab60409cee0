"""The CUDA transfer path: IPC-registered GPU KV caches ⇄ pinned L1, server-driven.

A CUDA worker exports each layer's storage by CUDA IPC (:meth:`CudaRuntime.export_layer`, with
the GPU's UUID); the server opens them once per registration (:meth:`CudaRuntime.open_layer`, on
its own ordinal of that UUID) and moves whole operations with a :class:`CopyPipeline` per GPU:
one launch of the kernels of ``cuda_ext/`` that reads or writes the pinned and mapped L1 arena
(:class:`PinnedHost`) directly, or (``staged``, and the pure-torch fallback) staging buffers
and the copy engine. Events order it with the engine (see ``docs/gpu.md``).

Importing this module does not import torch: :func:`torch_runtime` does, and returns None where
there is no usable GPU. Everything but :mod:`._cuda_torch` is written against the
:class:`Device` / :class:`CudaRuntime` protocols and tested with a simulated device.
"""

from ._batch import SEGMENT_DTYPE, Operation, PinnedHost, page_aligned, staged_segments
from ._cuda_build import (
    build_host_library,
    cache_root,
    extension_build_dir,
    extension_disabled,
    load_extension,
    source_digest,
)
from ._cuda_engine import (
    MODES,
    CopyPipeline,
    CudaRuntime,
    CudaTransfer,
    Device,
    Event,
    IpcLayer,
    Stream,
)
from ._cuda_torch import TorchDevice, TorchRuntime, kernel_choice, torch_runtime
from ._geometry import GPU_LAYOUT_KINDS, check_extent, geometry
from ._hostlib import HostLibrary, Plan

__all__ = [
    "GPU_LAYOUT_KINDS",
    "MODES",
    "SEGMENT_DTYPE",
    "CopyPipeline",
    "CudaRuntime",
    "CudaTransfer",
    "Device",
    "Event",
    "HostLibrary",
    "IpcLayer",
    "Operation",
    "PinnedHost",
    "Plan",
    "Stream",
    "TorchDevice",
    "TorchRuntime",
    "build_host_library",
    "cache_root",
    "check_extent",
    "extension_build_dir",
    "extension_disabled",
    "geometry",
    "kernel_choice",
    "load_extension",
    "page_aligned",
    "source_digest",
    "staged_segments",
    "torch_runtime",
]
