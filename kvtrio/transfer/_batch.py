"""What one CUDA operation copies, as flat arrays: block ids, chunks, and *segments*.

An :class:`Operation` is every chunk of a store or retrieve: all block ids in one int32 array,
and per chunk its block count, where its bytes are in host memory (an offset into
:class:`PinnedHost`) and how many. :meth:`PinnedHost.segments` turns it into the descriptors
the kernel reads (``kvt_segment`` of ``cuda_ext/kvtrio_batch.h``, :data:`SEGMENT_DTYPE`): per
chunk, the device address of its bytes (the mapped L1 arena: zero-copy), cut where two pinned
pieces of the arena meet. :func:`staged_segments` gives the same for a device staging buffer.

Everything is numpy over whole arrays: building an operation costs about the same for one chunk
or thirty-two (no Python loop per chunk). Where the pinned pieces' device addresses form one
range (UVA: the device address of page-locked memory is its host address) no chunk is cut;
elsewhere chunks that straddle two pieces are cut in a Python loop (at most one per GiB).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

__all__ = [
    "SEGMENT_DTYPE",
    "Operation",
    "PinnedHost",
    "Pinner",
    "page_aligned",
    "staged_segments",
]

Array = npt.NDArray[Any]

SEGMENT_DTYPE = np.dtype(
    [("address", "<u8"), ("start", "<i8"), ("length", "<i8"), ("first_id", "<i4"),
     ("n_ids", "<i4")]
)  # fmt: skip
"""``kvt_segment``: 32 bytes, checked against the host library in the tests."""


Chunk = tuple[int, int, int, int]
"""One chunk of an operation: (host offset, bytes, first id, block count)."""


@attrs.frozen
class Operation:
    """The chunks of one store or retrieve (see the module doc).

    Per-chunk facts are plain Python tuples: for the few to few dozen chunks of an operation,
    a loop over tuples and one ``np.array`` costs less than a dozen numpy calls."""

    ids: npt.NDArray[np.int32]
    """Every chunk's block ids, in order (-1: no engine block: a retrieve leaves that block
    alone, a store writes zeros for it, the tail of a prompt's partial chunk)."""
    rows: tuple[Chunk, ...]
    """Per chunk: (host offset, bytes, where its ids start in :attr:`ids`, how many)."""

    @classmethod
    def of(cls, chunks: Sequence[tuple[Sequence[int], int, int]]) -> Operation:
        """From ``(block ids, host offset, bytes)`` per chunk (the server's slots)."""
        ids: list[int] = []
        rows = []
        for block_ids, offset, nbytes in chunks:
            rows.append((offset, nbytes, len(ids), len(block_ids)))
            ids += block_ids
        return cls(np.array(ids, np.int32), tuple(rows))

    @property
    def chunks(self) -> int:
        return len(self.rows)

    def column(self, index: int) -> npt.NDArray[np.int64]:
        return np.array([row[index] for row in self.rows], np.int64)

    @property
    def offsets(self) -> npt.NDArray[np.int64]:
        return self.column(0)

    @property
    def nbytes(self) -> npt.NDArray[np.int64]:
        return self.column(1)

    @property
    def first_ids(self) -> npt.NDArray[np.int64]:
        return self.column(2)

    @property
    def counts(self) -> npt.NDArray[np.int64]:
        return self.column(3)

    def select(self, first: int, stop: int) -> Operation:
        """Chunks ``[first, stop)`` as an operation of their own."""
        rows = self.rows[first:stop]
        if not rows:
            return Operation(self.ids[:0], ())
        base = rows[0][2]
        end = rows[-1][2] + rows[-1][3]
        return Operation(self.ids[base:end],
                         tuple((o, n, f - base, c) for o, n, f, c in rows))  # fmt: skip


def _segments(rows: list[tuple[int, int, int, int]]) -> npt.NDArray[np.void]:
    """:data:`SEGMENT_DTYPE` records from (address, start, length, first_id | n_ids << 32)."""
    return np.array(rows, np.int64).reshape(-1, 4).view(SEGMENT_DTYPE).reshape(-1)


def staged_segments(op: Operation, address: int) -> npt.NDArray[np.void]:
    """One segment per chunk, the chunks packed one after the other from device ``address``."""
    rows = []
    for _offset, nbytes, first, count in op.rows:
        rows.append((address, 0, nbytes, first | count << 32))
        address += nbytes
    return _segments(rows)


def page_aligned(nbytes: int) -> npt.NDArray[np.uint8]:
    """``nbytes`` of zeroed host memory of its own pages (anonymous ``mmap``): pinning it never
    touches a page another allocation pins too (CUDA refuses a second registration of a page)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8)[:nbytes]


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
        self._deltas: dict[int, npt.NDArray[np.int64]] = {}
        """Per GPU and pinned piece: device address minus offset in the memory."""
        self._contiguous: dict[int, int] = {}
        """Per GPU whose pieces' device addresses are one range: its single delta."""
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
        if ordinal in self._deltas:
            return
        starts = range(0, self.memory.nbytes, self.piece_bytes)
        deltas = np.array(
            [mapped_address(self.address + start) - start for start in starts], np.int64
        )
        self._deltas[ordinal] = deltas
        if len(set(deltas.tolist())) == 1:  # UVA: one address range, pieces need no cut
            self._contiguous[ordinal] = int(deltas[0])

    def mapped(self, ordinal: int) -> bool:
        return ordinal in self._deltas

    def segments(self, op: Operation, ordinal: int) -> npt.NDArray[np.void]:
        """The operation's segments in this memory as GPU ``ordinal`` addresses it (mapped):
        one per chunk, or more where the device addresses of two pinned pieces a chunk
        straddles are not contiguous. ``ValueError`` for a chunk outside the memory."""
        size, piece_bytes = self.memory.nbytes, self.piece_bytes
        delta = self._contiguous.get(ordinal)
        deltas = self._deltas[ordinal]
        rows = []
        for offset, nbytes, first, count in op.rows:
            if offset < 0 or offset + nbytes > size:
                raise ValueError(f"[{offset}, {offset + nbytes}) is outside the pinned memory")
            ids = first | count << 32  # first_id, n_ids: int32 each, little-endian
            if delta is not None:
                rows.append((offset + delta, 0, nbytes, ids))
                continue
            start = offset
            while offset < start + nbytes:  # cut where pieces with separate mappings meet
                index = offset // piece_bytes
                cut = min(start + nbytes, (index + 1) * piece_bytes)
                rows.append((int(deltas[index]) + offset, offset - start, cut - offset, ids))
                offset = cut
        return _segments(rows)

    def close(self) -> None:
        """Unpin every piece (blocking)."""
        tokens, self._tokens = self._tokens, []
        for token in tokens:
            self._pinner.unpin(token)
