"""What one CUDA operation copies, as flat arrays: block ids, chunks, and *segments*.

An :class:`Operation` is every chunk of a store or retrieve: all block ids in one int32 array,
and per chunk its block count, where its bytes are in host memory (an offset into
:class:`PinnedHost`) and how many. :meth:`PinnedHost.segments` turns it into the descriptors
the kernel reads (``kvt_segment`` of ``cuda_ext/kvtrio_batch.h``, :data:`SEGMENT_DTYPE`): per
chunk, the device address of its bytes (the mapped L1 arena: zero-copy), cut where two pinned
pieces of the arena meet. :func:`staged_segments` gives the same for a device staging buffer.

Everything is numpy over whole arrays: building an operation costs the same few microseconds
for one chunk or thirty-two (no Python loop per chunk, except over chunks that straddle two
pinned pieces, at most one per GiB).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

__all__ = ["SEGMENT_DTYPE", "Operation", "PinnedHost", "Pinner", "staged_segments"]

Array = npt.NDArray[Any]

SEGMENT_DTYPE = np.dtype(
    [("address", "<u8"), ("start", "<i8"), ("length", "<i8"), ("first_id", "<i4"),
     ("n_ids", "<i4")]
)  # fmt: skip
"""``kvt_segment``: 32 bytes, checked against the host library in the tests."""


@attrs.frozen
class Operation:
    """The chunks of one store or retrieve (see the module doc). Arrays are not copied."""

    ids: npt.NDArray[np.int32]
    """Every chunk's block ids, in order (-1: a block the engine keeps, retrieves only)."""
    counts: npt.NDArray[np.int64]
    """Blocks per chunk."""
    offsets: npt.NDArray[np.int64]
    """Where each chunk's bytes start in the host memory."""
    nbytes: npt.NDArray[np.int64]
    """Bytes per chunk."""

    @classmethod
    def of(cls, chunks: Sequence[tuple[Sequence[int], int, int]]) -> Operation:
        """From ``(block ids, host offset, bytes)`` per chunk (the server's slots)."""
        ids = np.fromiter(itertools.chain.from_iterable(c[0] for c in chunks), np.int32)
        counts = np.fromiter((len(c[0]) for c in chunks), np.int64, len(chunks))
        offsets = np.fromiter((c[1] for c in chunks), np.int64, len(chunks))
        nbytes = np.fromiter((c[2] for c in chunks), np.int64, len(chunks))
        return cls(ids, counts, offsets, nbytes)

    @property
    def chunks(self) -> int:
        return len(self.counts)

    @property
    def first_ids(self) -> npt.NDArray[np.int64]:
        """Where each chunk's ids start in :attr:`ids`."""
        return np.cumsum(self.counts) - self.counts

    def select(self, first: int, stop: int) -> Operation:
        """Chunks ``[first, stop)`` as an operation of their own."""
        starts = self.first_ids
        lo = int(starts[first]) if first < self.chunks else len(self.ids)
        hi = int(starts[stop - 1] + self.counts[stop - 1]) if stop > first else lo
        return Operation(self.ids[lo:hi], self.counts[first:stop], self.offsets[first:stop],
                         self.nbytes[first:stop])  # fmt: skip


def staged_segments(op: Operation, address: int) -> npt.NDArray[np.void]:
    """One segment per chunk, the chunks packed one after the other from device ``address``."""
    segments = np.empty(op.chunks, SEGMENT_DTYPE)
    segments["address"] = address + (np.cumsum(op.nbytes) - op.nbytes)
    segments["start"] = 0
    segments["length"] = op.nbytes
    segments["first_id"] = op.first_ids
    segments["n_ids"] = op.counts
    return segments


class Pinner(Protocol):
    """What page-locks host memory: a :class:`~._cuda_engine.CudaRuntime` or a device."""

    def pin(self, memory: Array) -> Any: ...

    def unpin(self, token: Any) -> None: ...


class PinnedHost:
    """Host memory (the L1 arena) page-locked and mapped in pieces of ``piece_bytes``.

    ``cudaHostRegister`` of one huge range is slow and may fail; pieces are registered one by
    one, and a copy is never handed a range that straddles two (:meth:`pieces` and
    :meth:`segments` cut it).
    """

    def __init__(self, pinner: Pinner, memory: Array, piece_bytes: int = 1 << 30) -> None:
        self.memory = memory
        self.piece_bytes = piece_bytes
        self._pinner = pinner
        self._tokens: list[Any] = []
        self._device_bases: dict[int, npt.NDArray[np.uint64]] = {}
        try:
            for start in range(0, memory.nbytes, piece_bytes):
                self._tokens.append(pinner.pin(memory[start : start + piece_bytes]))
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> int:
        return int(self.memory.__array_interface__["data"][0])

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

    def map(self, ordinal: int, mapped_address: Any) -> None:
        """Record each piece's device address for GPU ``ordinal`` (``mapped_address(host)``;
        blocking: one driver call per piece). Done once, at the first mapped registration."""
        if ordinal in self._device_bases:
            return
        starts = range(0, self.memory.nbytes, self.piece_bytes)
        self._device_bases[ordinal] = np.array(
            [mapped_address(self.address + start) for start in starts], np.uint64
        )

    def mapped(self, ordinal: int) -> bool:
        return ordinal in self._device_bases

    def segments(self, op: Operation, ordinal: int) -> npt.NDArray[np.void]:
        """The operation's segments in this memory as GPU ``ordinal`` addresses it (mapped)."""
        end = op.offsets + op.nbytes
        if len(op.offsets) and (op.offsets.min() < 0 or end.max() > self.memory.nbytes):
            raise ValueError("a chunk lies outside the pinned memory")
        bases = self._device_bases[ordinal]
        piece = op.offsets // self.piece_bytes
        inside = (end - 1) // self.piece_bytes == piece
        first_ids = op.first_ids
        if inside.all():  # the common case: no chunk straddles two pieces
            segments = np.empty(op.chunks, SEGMENT_DTYPE)
            segments["address"] = bases[piece] + (op.offsets - piece * self.piece_bytes).astype(
                np.uint64
            )
            segments["start"] = 0
            segments["length"] = op.nbytes
            segments["first_id"] = first_ids
            segments["n_ids"] = op.counts
            return segments
        rows = []
        for i in range(op.chunks):
            offset, stop = int(op.offsets[i]), int(end[i])
            while offset < stop:
                index = offset // self.piece_bytes
                cut = min(stop, (index + 1) * self.piece_bytes)
                address = int(bases[index]) + offset - index * self.piece_bytes
                rows.append((address, offset - int(op.offsets[i]), cut - offset,
                             int(first_ids[i]), int(op.counts[i])))  # fmt: skip
                offset = cut
        return np.array(rows, SEGMENT_DTYPE)

    def close(self) -> None:
        """Unpin every piece (blocking)."""
        tokens, self._tokens = self._tokens, []
        for token in tokens:
            self._pinner.unpin(token)
