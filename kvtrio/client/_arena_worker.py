"""The copy path of CPU tensors: the worker copies through the L1 arena, pipelined with the
protocol.

The arena named by the registration is mapped here (:meth:`ArenaCopies.attach`); each chunk is
copied between the engine's tensors and its L1 slot by a :class:`kvtrio.transfer.Transfer`
engine (the CPU one, :data:`kvtrio.transfer.CPU_TRANSFER`).

A **store** of many chunks is sent as a few requests over consecutive chunk ranges
(:meth:`Span.batches`: one chunk first, then twice as many each time, up to about
:data:`BATCH_BYTES` of chunks), all submitted at once. A batch is copied as soon as its reply
is in, while the server reserves and zeroes the next batches' slots: the store waits for one
round trip and one chunk's zeroing before its first copy instead of for every chunk's. Each
batch stands alone: one the server refuses (an error reply) fails only its own chunks. After
the last copy one commit covers every batch; it is not waited for here: it is answered while
the transfer thread already copies the next operation.

A **retrieve** is one request when its chunks are in L1. Chunks the lookup started loading
from L2 come in parts (*partial* retrieves): the server answers as soon as the first chunk is
loaded, the rest ``loading``, and the worker asks for the rest before it copies what it got,
so the copies overlap the loads. One release covers every part.

Chunks that could not be moved are counted by cause in the adapter's
:class:`~._failures.Failures`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..protocol import (
    Commit,
    CommitReply,
    CudaCache,
    Registered,
    Release,
    Reply,
    Request,
    RetrieveReply,
    StoreReply,
)
from ..shm import SharedArena
from ..transfer import CPU_TRANSFER, CpuTransfer, KVLayout, Transfer, scatter_parts
from ._copies import Retrieved, Span, count_failed_slots, failure_cause, reply_of
from ._failures import Failures
from ._sync import Client

__all__ = ["WRITE_MARGIN", "ArenaCopies"]

log = logging.getLogger("kvtrio.client")

WRITE_MARGIN = 2.0
"""Seconds before a reservation expires after which a slot is no longer written."""


def _token_rows(layout: KVLayout, chunk: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A canonical chunk viewed as ``(layers, kv, tokens, row bytes)``."""
    row_bytes = layout.row_elements * layout.element_size
    return chunk.reshape(layout.num_layers, layout.kv, -1, row_bytes)


def _some_blocks(
    layout: KVLayout, chunk: np.ndarray[Any, Any], start: int, stop: int
) -> np.ndarray[Any, Any]:
    """A contiguous copy of blocks ``[start, stop)`` of a canonical chunk, as a chunk of
    ``stop - start`` blocks."""
    size = layout.block_size
    rows = _token_rows(layout, chunk)[:, :, start * size : stop * size]
    return np.ascontiguousarray(rows).reshape(-1)


class ArenaCopies:
    """The :class:`~._copies.WorkerCopies` of CPU tensors (see the module docstring).

    ``arrays`` are numpy views of the engine's layers; ``on_not_registered`` is called (in any
    thread) when the server says this connection has no registration.
    """

    device = "cpu"
    cuda: CudaCache | None = None

    def __init__(
        self,
        client: Client,
        layout: KVLayout,
        arrays: list[np.ndarray[Any, Any]],
        failures: Failures,
        on_not_registered: Callable[[], None],
        transfer: Transfer = CPU_TRANSFER,
    ) -> None:
        self.client = client
        self.layout = layout
        self.arrays = arrays
        self.failures = failures
        self.transfer = transfer
        self.arena: SharedArena | None = None
        """The mapped arena of the latest registration."""
        self._on_not_registered = on_not_registered

    def engine_event(self) -> bytes:
        return b""  # the engine's thread has finished writing its tensors when it submits

    def attach(self, registered: Registered) -> None:
        """Map the registration's arena (kept if the server hands out the same one again)."""
        old = self.arena
        if old is not None and old.path == registered.arena_path:
            return
        self.arena = SharedArena.attach(registered.arena_path, registered.arena_size)
        if old is not None:
            old.close()

    def close(self) -> None:
        arena, self.arena = self.arena, None
        if arena is not None:
            arena.close()

    def _mapped(self) -> SharedArena:
        if self.arena is None:  # pragma: no cover - the adapter attaches before any operation
            raise RuntimeError("no arena mapped")
        return self.arena

    def _send(self, request: Request) -> Future[Reply]:
        return self.client.submit(request, fail_fast=True)

    def _refused(self, exc: BaseException, count: Callable[[str], None]) -> bool:
        """Count a request the server did not answer; True if it said "not registered"."""
        cause = failure_cause(exc)
        count(cause)
        if cause == "internal":
            log.error("a kvtrio request failed: %r", exc)
        return cause == "not_registered"

    def _abandon(self, span: Span, future: Future[Reply], status: str) -> None:
        """A batch answered after its operation gave up (a copy raised): drop its
        reservations (``write``) or release its pins (``read``) rather than let them
        expire."""
        with contextlib.suppress(Exception):
            reply = future.result()
            if isinstance(reply, StoreReply | RetrieveReply):
                chunks = span.hashes_of(reply.slots, status)
                if chunks and status == "write":
                    self._send(Commit(span.wire_id, failed=chunks))
                elif chunks:
                    self._send(Release(span.wire_id, chunks))

    # ----------------------------------------------------------------- store

    def store(self, span: Span, event: bytes = b"") -> list[Future[Reply]]:
        """Write every batch's slots and commit them; returns the commit, not waited for
        (what it could not store is counted when it is answered)."""
        arena = self._mapped()
        rid = span.request_id
        batches = span.batches()
        started = time.monotonic()
        stores = [self._send(span.store(batch)) for batch in batches]
        written: list[bytes] = []
        failed: list[bytes] = []
        unregistered = False
        handled = 0
        try:
            for batch, future in zip(batches, stores, strict=True):
                handled += 1
                try:
                    reply = reply_of(future, StoreReply)
                except Exception as exc:

                    def count(cause: str, n: int = len(batch), exc: Exception = exc) -> None:
                        self.failures.store(rid, cause, n, exc)

                    unregistered |= self._refused(exc, count)
                    continue
                count_failed_slots(self.failures, rid, reply)
                deadline = started + reply.expires_in - WRITE_MARGIN
                self._write(arena, span, reply, deadline, written, failed)
        finally:
            for future in stores[handled:]:  # only after an unexpected error
                future.add_done_callback(lambda f: self._abandon(span, f, "write"))
            if unregistered:
                self._on_not_registered()
            commit = Commit(span.wire_id, tuple(written), tuple(failed))
            commits = [self._commit(rid, commit)] if written or failed else []
        return commits

    def _write(
        self,
        arena: SharedArena,
        span: Span,
        reply: StoreReply,
        deadline: float,
        written: list[bytes],
        failed: list[bytes],
    ) -> None:
        """Copy the engine's blocks into the ``write`` slots; add the chunk hashes to
        ``written`` or ``failed``."""
        failed_before = len(failed)
        for slot in reply.slots:
            if slot.status != "write":
                continue
            chunk_hash = span.hashes[slot.chunk - span.first]
            if time.monotonic() > deadline:  # never write into a slot that may be reassigned
                failed.append(chunk_hash)
                continue
            try:
                out = arena.view(slot.offset, slot.nbytes)
                blocks = span.blocks(slot.chunk)
                if len(blocks) == span.blocks_per_chunk:
                    self.transfer.gather(self.layout, self.arrays, blocks, out)
                else:  # the partial chunk: its blocks first; the rest stays zero (scrubbed)
                    part = np.empty(
                        self.layout.chunk_nbytes(len(blocks) * self.layout.block_size), np.uint8
                    )
                    self.transfer.gather(self.layout, self.arrays, blocks, part)
                    tokens = len(blocks) * self.layout.block_size
                    _token_rows(self.layout, out)[:, :, :tokens] = _token_rows(self.layout, part)
            except Exception:
                log.exception("copying chunk %d of %s into L1 failed", slot.chunk, span.request_id)
                failed.append(chunk_hash)
            else:
                written.append(chunk_hash)
        if len(failed) > failed_before:
            lost = len(failed) - failed_before
            self.failures.store(span.request_id, "copy", lost, "copy failed or too late")

    def _commit(self, request_id: str, commit: Commit) -> Future[Reply]:
        """Send ``commit``; count what it could not make visible when its answer comes."""
        future = self._send(commit)
        written = len(commit.written)

        def answered(future: Future[Reply]) -> None:
            try:
                reply = reply_of(future, CommitReply)
            except BaseException as exc:  # (a cancelled future too: never silently stored)

                def count(cause: str, exc: BaseException = exc) -> None:
                    self.failures.store(request_id, cause, written, exc)

                if written and self._refused(exc, count):
                    self._on_not_registered()
                return
            if reply.rejected:
                self.failures.store(
                    request_id, "expired", len(reply.rejected), "reservation expired"
                )

        future.add_done_callback(answered)
        return future

    # ----------------------------------------------------------------- retrieve

    def retrieve(self, span: Span, keep_before: int, event: bytes = b"") -> Retrieved:
        """Copy the chunks the server has into the engine's blocks, leaving the tokens before
        ``keep_before`` alone; which chunks were copied, and the causes of those the server
        did not answer. The read pins are released then (not waited for), also when a copy
        raised.

        Partial retrieves: the server answers at once what is in L1 (the whole range, when no
        L2 load is under way), else as soon as the first chunk's load is done; the chunks still
        loading are asked for again before the ready ones are copied."""
        layout, arena = self.layout, self._mapped()
        result = Retrieved()
        loaded, causes = result.loaded, result.causes
        start = 0
        future: Future[Reply] | None = self._send(span.retrieve(start))
        unregistered = False
        read: list[bytes] = []
        try:
            while future is not None:
                try:
                    reply = reply_of(future, RetrieveReply)
                except Exception as exc:

                    def count(cause: str, start: int = start) -> None:
                        causes.update((span.first + i, cause) for i in range(start, span.chunks))

                    unregistered = self._refused(exc, count)
                    future = None
                    break
                future = None
                rest = span.loading(reply)
                if rest is not None:  # asked for before the copies, answered during them
                    start, future = rest, self._send(span.retrieve(rest))
                read += span.hashes_of(reply.slots, "read")
                parts: list[tuple[Sequence[int], np.ndarray[Any, Any], int]] = []
                for slot in reply.slots:
                    if slot.status != "read":
                        continue
                    blocks = span.blocks(slot.chunk)
                    # only some blocks: those the engine has not, up to where it computes
                    skip = max(0, keep_before - slot.chunk * span.chunk_size) // layout.block_size
                    if blocks[skip:]:
                        parts.append((blocks[skip:], arena.view(slot.offset, slot.nbytes), skip))
                    loaded.add(slot.chunk)
                self._scatter(parts)
        finally:
            if read:
                self._send(Release(span.wire_id, tuple(read)))
            if future is not None:  # only after a copy raised
                future.add_done_callback(lambda f: self._abandon(span, f, "read"))
            if unregistered:
                self._on_not_registered()
        return result

    def _scatter(self, parts: list[tuple[Sequence[int], np.ndarray[Any, Any], int]]) -> None:
        """Copy part ``(blocks, chunk, first)``: blocks ``[first, first + len(blocks))`` of the
        canonical chunk ``chunk`` into the engine's ``blocks``. The CPU engine copies all the
        parts in one call (:func:`kvtrio.transfer.scatter_parts`: one GIL hand-off, no copy of a
        partial chunk's blocks); another engine copies a chunk at a time."""
        if isinstance(self.transfer, CpuTransfer):
            scatter_parts(self.layout, self.arrays, parts)
            return
        for blocks, data, first in parts:
            if first or len(blocks) < data.nbytes // self.layout.chunk_nbytes(
                self.layout.block_size
            ):
                data = _some_blocks(self.layout, data, first, first + len(blocks))
            self.transfer.scatter(self.layout, self.arrays, blocks, data)
