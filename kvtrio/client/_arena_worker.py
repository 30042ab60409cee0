"""The CPU worker's copies through the L1 arena, pipelined with the protocol.

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
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import attrs
import numpy as np

from ..errors import KvtrioError, NotRegistered, ProtocolError
from ..protocol import (
    Commit,
    CommitReply,
    Release,
    Reply,
    Request,
    Retrieve,
    RetrieveReply,
    Store,
    StoreReply,
)
from ..shm import SharedArena
from ..transfer import KVLayout, gather, scatter
from ._failures import Failures
from ._sync import Client

__all__ = [
    "BATCH_BYTES",
    "ArenaWorker",
    "Span",
    "count_failed_slots",
    "failure_cause",
    "reply_of",
    "when_all",
]

log = logging.getLogger("kvtrio.client")

BATCH_BYTES = 32 << 20
"""Chunk bytes per request of a split store or retrieve (at least one chunk)."""
WRITE_MARGIN = 2.0
"""Seconds before a reservation expires after which a slot is no longer written."""

_R = TypeVar("_R", bound=Reply)


@attrs.frozen
class Span:
    """The full chunks of one store or retrieve: chunk ``first + i`` has ``hashes[i]``."""

    request_id: str
    first: int
    hashes: tuple[bytes, ...]
    parent: bytes
    """The hash of chunk ``first - 1`` (empty for the prompt's first chunk)."""
    chunk_size: int
    chunk_bytes: int
    blocks_per_chunk: int
    block_ids: Sequence[int]
    """The engine blocks of the request from its first token on."""

    def blocks(self, chunk: int) -> Sequence[int]:
        """The engine blocks of chunk ``chunk`` (an index in the prompt)."""
        per = self.blocks_per_chunk
        return self.block_ids[chunk * per : (chunk + 1) * per]

    def batches(self, limit: int = BATCH_BYTES) -> list[range]:
        """Consecutive ranges of ``range(len(hashes))``: 1 chunk, then doubling, at most
        ``limit`` bytes of chunks each (but at least one chunk). The first reply comes back
        soonest; the later ones are answered while the earlier batches copy."""
        cap = max(1, limit // max(1, self.chunk_bytes))
        batches, start, size = [], 0, 1
        while start < len(self.hashes):
            end = min(len(self.hashes), start + size)
            batches.append(range(start, end))
            start, size = end, min(cap, size * 2)
        return batches

    def tokens(self, batch: range) -> tuple[int, int]:
        """The token range ``[start, end)`` of a batch."""
        return (self.first + batch.start) * self.chunk_size, (
            self.first + batch.stop
        ) * self.chunk_size

    @property
    def chunks(self) -> int:
        return len(self.hashes)

    def retrieve(self, start: int, **fields: Any) -> Retrieve:
        """A partial retrieve of chunks ``start …`` (indices into ``hashes``) to the end."""
        return Retrieve(
            self.request_id,
            (self.first + start) * self.chunk_size,
            (self.first + self.chunks) * self.chunk_size,
            self.hashes[start:],
            partial=True,
            **fields,
        )

    def loading(self, reply: RetrieveReply) -> int | None:
        """The index of the first chunk a partial retrieve's reply says is still loading."""
        loading = [s.chunk for s in reply.slots if s.status == "loading"]
        return min(loading) - self.first if loading else None

    def hashes_of(self, slots: Sequence[Any], status: str) -> tuple[bytes, ...]:
        """The chunk hashes of the slots with ``status``."""
        return tuple(self.hashes[s.chunk - self.first] for s in slots if s.status == status)


def failure_cause(exc: BaseException) -> str:
    """The ``store_failures`` / ``retrieve_failures`` cause of a failed request."""
    if isinstance(exc, NotRegistered):
        return "not_registered"
    if isinstance(exc, KvtrioError):
        return "server"
    return "internal"


def reply_of(future: Future[Reply], reply_type: type[_R]) -> _R:
    """The reply a future settled with, checked against ``reply_type`` (raises what it
    raised)."""
    reply = future.result()
    if not isinstance(reply, reply_type):  # pragma: no cover - decode_reply guarantees it
        raise ProtocolError(f"expected {reply_type.__name__}, got {type(reply).__name__}")
    return reply


def when_all(futures: Sequence[Future[Reply]], then: Callable[[], None]) -> None:
    """Call ``then`` once every future is done (at once if there are none; else in the
    thread that settles the last one)."""
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[Reply]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    if not futures:
        then()
    for future in futures:
        future.add_done_callback(one_done)


def count_failed_slots(failures: Failures, request_id: str, reply: StoreReply) -> None:
    """Count the chunks a store's reply says there is no room for."""
    failed = sum(1 for slot in reply.slots if slot.status == "failed")
    if failed:
        failures.store(request_id, "no_room", failed, "L1 full of pinned chunks")


def _tail_blocks(layout: KVLayout, chunk: np.ndarray[Any, Any], skip: int) -> np.ndarray[Any, Any]:
    """A contiguous copy of a canonical chunk without its first ``skip`` blocks."""
    row_bytes = layout.row_elements * layout.element_size
    rows = chunk.reshape(layout.num_layers, layout.kv, -1, row_bytes)
    return np.ascontiguousarray(rows[:, :, skip * layout.block_size :]).reshape(-1)


class ArenaWorker:
    """A :class:`~.WorkerAdapter`'s copies for CPU tensors (its transfer thread calls it).

    ``on_not_registered`` is called (in any thread) when the server says this connection has
    no registration.
    """

    def __init__(
        self,
        client: Client,
        layout: KVLayout,
        arrays: list[np.ndarray[Any, Any]],
        failures: Failures,
        on_not_registered: Callable[[], None],
    ) -> None:
        self.client = client
        self.layout = layout
        self.arrays = arrays
        self.failures = failures
        self._on_not_registered = on_not_registered

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
                    self._send(Commit(span.request_id, failed=chunks))
                elif chunks:
                    self._send(Release(span.request_id, chunks))

    # ----------------------------------------------------------------- store

    def store(self, arena: SharedArena, span: Span) -> list[Future[Reply]]:
        """Write every batch's slots and commit them; returns the commit, not waited for
        (what it could not store is counted when it is answered)."""
        rid = span.request_id
        batches = span.batches()
        started = time.monotonic()
        stores = [
            self._send(
                Store(
                    rid,
                    *span.tokens(batch),
                    span.hashes[batch.start : batch.stop],
                    parent_hash=span.hashes[batch.start - 1] if batch.start else span.parent,
                )
            )
            for batch in batches
        ]
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
            commit = Commit(rid, tuple(written), tuple(failed))
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
                gather(self.layout, self.arrays, span.blocks(slot.chunk), out)
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

    def retrieve(
        self,
        arena: SharedArena,
        span: Span,
        keep_before: int,
        loaded: set[int],
        causes: dict[int, str],
        copied: Callable[[], None] = lambda: None,
    ) -> None:
        """Copy the chunks the server has into the engine's blocks, leaving the tokens before
        ``keep_before`` alone. Each chunk copied is added to ``loaded``; chunks the server did
        not answer get the cause in ``causes``; ``copied`` is called when that is all
        (unless a copy raised). The read pins are released then (not waited for), also when
        a copy raised.

        Partial retrieves: the server answers at once what is in L1 (the whole range, when no
        L2 load is under way), else as soon as the first chunk's load is done; the chunks still
        loading are asked for again before the ready ones are copied."""
        layout = self.layout
        rid = span.request_id
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
                for slot in reply.slots:
                    if slot.status != "read":
                        continue
                    blocks = span.blocks(slot.chunk)
                    data = arena.view(slot.offset, slot.nbytes)
                    skip = max(0, keep_before - slot.chunk * span.chunk_size) // layout.block_size
                    if skip:
                        blocks, data = blocks[skip:], _tail_blocks(layout, data, skip)
                    if blocks:
                        scatter(layout, self.arrays, blocks, data)
                    loaded.add(slot.chunk)
            copied()
        finally:
            if read:
                self._send(Release(rid, tuple(read)))
            if future is not None:  # only after a copy raised
                future.add_done_callback(lambda f: self._abandon(span, f, "read"))
            if unregistered:
                self._on_not_registered()
