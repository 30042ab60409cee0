"""The host library: the CUDA kernels' index arithmetic, compiled for the CPU, through ctypes.

``cuda_ext/kvtrio_host.cpp`` runs the kernels' per-vector body (``kvt_move`` of
``kvtrio_index.h``) in a loop over host memory, and the operation kernel's (``kvt_move_unit``
of ``kvtrio_batch.h``, :meth:`HostLibrary.run`). :class:`HostLibrary` calls it, so tests compare
what the kernels would copy with the numpy reference, byte for byte, on machines without a GPU;
the fake CUDA device of the tests uses it as its "kernel". Nothing here is on a hot path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from ._batch import SEGMENT_DTYPE
from ._geometry import GEOMETRY_FIELDS, geometry
from ._layouts import KVLayout

__all__ = ["HostLibrary", "Plan"]

Array = npt.NDArray[Any]
_I64P = ctypes.POINTER(ctypes.c_int64)
_U64P = ctypes.POINTER(ctypes.c_uint64)
_U8P = ctypes.POINTER(ctypes.c_uint8)


@attrs.frozen
class Plan:
    """What ``kvt_make_plan`` derived from a geometry."""

    run_elems: int
    """Elements per run (the unit contiguous in both the engine and the chunk)."""
    run: int
    """Bytes per run."""
    runs_per_block: int
    vec: int
    """Bytes per vector move: 16, 8, 4, 2 or 1."""


def _i64(values: Sequence[int]) -> Array:
    return np.ascontiguousarray(values, dtype=np.int64)


class HostLibrary:
    """ctypes binding of the host library at ``path`` (see :func:`build_host_library`)."""

    def __init__(self, path: str | Path) -> None:
        lib = ctypes.CDLL(str(path))
        lib.kvt_host_plan.argtypes = [_I64P, ctypes.c_uint64, _I64P]
        lib.kvt_host_plan.restype = ctypes.c_int
        lib.kvt_host_engine_offsets.argtypes = [
            _I64P, _I64P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _I64P
        ]  # fmt: skip
        lib.kvt_host_engine_offsets.restype = ctypes.c_int
        lib.kvt_host_layer_bytes.argtypes = [_I64P, ctypes.c_int64]
        lib.kvt_host_layer_bytes.restype = ctypes.c_int64
        lib.kvt_host_copy.argtypes = [
            _I64P, ctypes.c_int64, _U64P, _I64P, ctypes.c_int64, _U8P, ctypes.c_int, _I64P
        ]  # fmt: skip
        lib.kvt_host_copy.restype = ctypes.c_int
        lib.kvt_host_run.argtypes = [
            _I64P, ctypes.c_int64, _U64P, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int, _I64P,
        ]  # fmt: skip
        lib.kvt_host_run.restype = ctypes.c_int
        lib.kvt_host_run_launches.argtypes = [
            _I64P, ctypes.c_int64, _U64P, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, _I64P,
        ]  # fmt: skip
        lib.kvt_host_run_launches.restype = ctypes.c_int
        lib.kvt_host_segment_bytes.argtypes = []
        lib.kvt_host_segment_bytes.restype = ctypes.c_int64
        lib.kvt_host_error_message.argtypes = [ctypes.c_int]
        lib.kvt_host_error_message.restype = ctypes.c_char_p
        self._lib = lib
        self.path = Path(path)

    def _check(self, code: int) -> None:
        if code != 0:
            raise ValueError(self._lib.kvt_host_error_message(code).decode())

    @staticmethod
    def _geometry(values: Sequence[int]) -> Array:
        array = _i64(values)
        if array.shape != (GEOMETRY_FIELDS,):
            raise ValueError(f"a geometry has {GEOMETRY_FIELDS} fields, got {array.shape}")
        return array

    # ----------------------------------------------------------------- raw entry points

    def plan(self, geometry: Sequence[int], pointer_bits: int = 0) -> Plan:
        """The plan of a geometry (``ValueError`` for an invalid one)."""
        out = np.zeros(4, np.int64)
        g = self._geometry(geometry)
        self._check(self._lib.kvt_host_plan(g.ctypes.data_as(_I64P), pointer_bits,
                                            out.ctypes.data_as(_I64P)))  # fmt: skip
        return Plan(*(int(v) for v in out))

    def layer_bytes(self, geometry: Sequence[int], blocks: int) -> int:
        """Bytes of one layer's share of a chunk of ``blocks`` blocks."""
        result = int(self._lib.kvt_host_layer_bytes(self._geometry(geometry).ctypes.data_as(_I64P),
                                                    blocks))  # fmt: skip
        if result < 0:
            self._check(-result)
        return result

    def engine_offsets(
        self, geometry: Sequence[int], block_ids: Sequence[int], first: int, count: int
    ) -> Array:
        """Engine byte offsets (from the layer base; -1: skipped block) of chunk bytes
        ``[first, first + count)`` of a layer."""
        g, ids = self._geometry(geometry), _i64(block_ids)
        out = np.zeros(count, np.int64)
        self._check(
            self._lib.kvt_host_engine_offsets(
                g.ctypes.data_as(_I64P), ids.ctypes.data_as(_I64P), len(ids), first, count,
                out.ctypes.data_as(_I64P),
            )
        )  # fmt: skip
        return out

    def copy(
        self,
        geometry: Sequence[int],
        bases: Sequence[int],
        block_ids: Sequence[int],
        chunk_address: int,
        *,
        gather: bool,
    ) -> int:
        """Run the kernel's work on raw host addresses; return the vector width it used.

        The caller guarantees that every address and the chunk's size are right: this writes
        wherever it is told to.
        """
        g, ids = self._geometry(geometry), _i64(block_ids)
        addresses = np.ascontiguousarray(bases, dtype=np.uint64)
        vec = ctypes.c_int64(0)
        self._check(
            self._lib.kvt_host_copy(
                g.ctypes.data_as(_I64P), len(addresses), addresses.ctypes.data_as(_U64P),
                ids.ctypes.data_as(_I64P), len(ids), ctypes.cast(chunk_address, _U8P),
                int(gather), ctypes.byref(vec),
            )
        )  # fmt: skip
        return vec.value

    @property
    def segment_bytes(self) -> int:
        """``sizeof(kvt_segment)`` as the C++ compiler laid it out."""
        return int(self._lib.kvt_host_segment_bytes())

    def run(
        self,
        geometry: Sequence[int],
        bases: Sequence[int],
        ids: npt.NDArray[np.int32],
        segments: npt.NDArray[np.void],
        *,
        gather: bool,
    ) -> tuple[int, int]:
        """Run the operation kernel's work (every segment, ``kvt_move_unit``) on raw host
        addresses; return (vector width, vectors per unit). Same checks as the launcher.

        The caller guarantees that every address is right: this writes wherever it is told to.
        """
        g = self._geometry(geometry)
        addresses = np.ascontiguousarray(bases, dtype=np.uint64)
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        segments = np.ascontiguousarray(segments, dtype=SEGMENT_DTYPE)
        out = np.zeros(2, np.int64)
        self._check(
            self._lib.kvt_host_run(
                g.ctypes.data_as(_I64P), len(addresses), addresses.ctypes.data_as(_U64P),
                ids.ctypes.data, len(ids), segments.ctypes.data, len(segments), int(gather),
                out.ctypes.data_as(_I64P),
            )
        )  # fmt: skip
        return int(out[0]), int(out[1])

    def run_launches(
        self,
        geometry: Sequence[int],
        bases: Sequence[int],
        ids: npt.NDArray[np.int32],
        segments: npt.NDArray[np.void],
        *,
        gather: bool,
        max_segments: int,
        max_ids: int,
    ) -> int:
        """:meth:`run` cut into launches as the CUDA launcher cuts an operation bigger than one
        launch's parameter (here with the limits given); returns the number of launches."""
        g = self._geometry(geometry)
        addresses = np.ascontiguousarray(bases, dtype=np.uint64)
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        segments = np.ascontiguousarray(segments, dtype=SEGMENT_DTYPE)
        launches = ctypes.c_int64(0)
        self._check(
            self._lib.kvt_host_run_launches(
                g.ctypes.data_as(_I64P), len(addresses), addresses.ctypes.data_as(_U64P),
                ids.ctypes.data, len(ids), segments.ctypes.data, len(segments), int(gather),
                max_segments, max_ids, ctypes.byref(launches),
            )
        )  # fmt: skip
        return launches.value

    # ----------------------------------------------------------------- numpy arrays

    def gather(
        self, layout: KVLayout, layers: Sequence[Array], block_ids: Sequence[int], out: Array
    ) -> int:
        """Gather numpy layers (any strides) into the chunk buffer ``out``; returns the vector
        width. Same contract as :func:`kvtrio.transfer.gather`."""
        return self._copy_arrays(layout, layers, block_ids, out, gather=True)

    def scatter(
        self, layout: KVLayout, layers: Sequence[Array], block_ids: Sequence[int], src: Array
    ) -> int:
        """Scatter the chunk buffer ``src`` into numpy layers; block id -1 leaves a block alone."""
        return self._copy_arrays(layout, layers, block_ids, src, gather=False)

    def _copy_arrays(
        self,
        layout: KVLayout,
        layers: Sequence[Array],
        block_ids: Sequence[int],
        chunk: Array,
        *,
        gather: bool,
    ) -> int:
        if len(layers) != layout.num_layers:
            raise ValueError(f"expected {layout.num_layers} layer arrays, got {len(layers)}")
        strides = set()
        for i, layer in enumerate(layers):
            if layer.shape != layout.layer_shape or layer.dtype.itemsize != layout.element_size:
                raise ValueError(f"layer {i}: expected {layout.layer_shape} of {layout.dtype}")
            strides.add(layer.strides)
        if len(strides) != 1:
            raise ValueError("all layers must have the same strides")
        (byte_strides,) = strides
        size = layout.element_size
        if any(s % size or s < 0 for s in byte_strides):
            raise ValueError(f"layer strides {byte_strides} are not whole, positive elements")
        g = geometry(layout, [s // size for s in byte_strides])
        nbytes = layout.num_layers * self.layer_bytes(g, len(block_ids))
        if not chunk.flags.c_contiguous or chunk.nbytes != nbytes:
            raise ValueError(f"the chunk buffer must be {nbytes} contiguous bytes")
        bases = [layer.__array_interface__["data"][0] for layer in layers]
        return self.copy(g, bases, block_ids, chunk.ctypes.data, gather=gather)
