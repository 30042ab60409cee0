"""Write-behind: committed L1 chunks go to every backend, a batch at a time, off the request path.

A committed chunk is queued (bounded channel) to flusher tasks that frame it and store it in
every usable backend (with its L1 parent, to a backend that ``accepts_parents``); while queued or
being written it is pinned in L1. A full queue, in chunks or in bytes, skips the chunk and counts
it: never an unbounded queue.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ...l2 import header
from ...shm import SharedArena
from ...storage import L1Cache
from ._backends import Calls, TierBackend

__all__ = ["WriteBehind"]

CPU_LIMITER = trio.CapacityLimiter(2)
"""Checksums of chunks (xxh3, ~7 GB/s) run in worker threads, two at a time (stores and
loads share it)."""
_BATCH_CHUNKS = 32
_BATCH_BYTES = 64 << 20
"""A flusher writes at most this many queued chunks (or about this many bytes) per backend call:
one thread hop for the frames and one store per backend for many small chunks."""


class WriteBehind:
    """The write-behind queue of one tier and its flushers."""

    def __init__(
        self,
        backends: Sequence[TierBackend],
        l1: L1Cache,
        arena: SharedArena,
        calls: Calls,
        *,
        queue_size: int,
        flushers: int,
    ) -> None:
        self.backends = backends
        self.l1 = l1
        self.arena = arena
        self._calls = calls
        self._flushers = flushers
        self._send, self._receive = trio.open_memory_channel[tuple[bytes, bytes]](queue_size)
        self.queued = 0
        """Chunks in the queue (not yet taken by a flusher)."""
        self._queued_bytes = 0
        self.max_queued_bytes = arena.size // 4
        """Bytes of L1 the queue may pin (a quarter of it): a long queue of large chunks must
        not starve L1 of evictable space."""
        self.skipped_stores = 0

    def start(self, nursery: trio.Nursery) -> None:
        """Start the flushers in ``nursery`` (none without backends); they run until it is
        cancelled."""
        for _ in range(self._flushers if self.backends else 0):
            nursery.start_soon(self._flush, self._receive.clone())

    def write_behind(self, key: bytes, fingerprint: bytes) -> None:
        """Queue a committed L1 chunk for the backends (pinned until written); never waits.
        Skipped (and counted) when the queue is full, in chunks or in bytes."""
        if not self.backends:
            return
        size = self._size(key)
        if self._queued_bytes + size > self.max_queued_bytes:
            self.skipped_stores += 1
            return
        self.l1.pin(key)
        try:
            self._send.send_nowait((key, fingerprint))
        except trio.WouldBlock:
            self.l1.unpin(key)
            self.skipped_stores += 1
            return
        self.queued += 1
        self._queued_bytes += size

    async def _flush(self, receive: trio.MemoryReceiveChannel[tuple[bytes, bytes]]) -> None:
        """Write queued chunks to the backends, a batch at a time, until cancelled.

        A batch is the chunk received plus what is already queued (up to ``_BATCH_CHUNKS``
        chunks or ``_BATCH_BYTES``). Every chunk taken off the queue is unpinned exactly once,
        also when the store fails or the flusher is cancelled.
        """
        async for first in receive:
            batch = [first]
            self.queued -= 1
            try:
                nbytes = self._size(first[0])
                self._queued_bytes -= nbytes
                while len(batch) < _BATCH_CHUNKS and nbytes < _BATCH_BYTES:
                    try:
                        item = receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    batch.append(item)  # (no checkpoint before the finally can see it)
                    self.queued -= 1
                    size = self._size(item[0])
                    self._queued_bytes -= size
                    nbytes += size
                await self._store_batch(batch)
            finally:
                for key, _ in batch:
                    self.l1.unpin(key)

    def _size(self, key: bytes) -> int:
        entry = self.l1.get(key)
        return 0 if entry is None else entry.nbytes

    async def _store_batch(self, batch: Sequence[tuple[bytes, bytes]]) -> None:
        """Frame the (pinned) chunks in one worker thread and store them with one call per
        usable backend; count per key. Cancellation: the running store is cancelled."""
        keys: list[bytes] = []
        parents: list[bytes | None] = []
        fingerprints: list[bytes] = []
        payloads: list[memoryview] = []
        for key, fingerprint in batch:
            entry = self.l1.get(key)
            if entry is None:  # cannot happen while pinned; be safe
                continue
            keys.append(key)
            parents.append(entry.parent)
            fingerprints.append(fingerprint)
            payloads.append(self.arena.memory(entry.offset, entry.nbytes))
        if not keys:
            return
        heads = await trio.to_thread.run_sync(
            _headers, keys, fingerprints, payloads, limiter=CPU_LIMITER
        )
        buffers = [
            [memoryview(head), payload] for head, payload in zip(heads, payloads, strict=True)
        ]
        for tier_backend in self.backends:
            if not tier_backend.usable(trio.current_time()):
                tier_backend.count("stores_skipped", len(keys))
                continue
            backend = tier_backend.backend
            started = trio.current_time()
            try:
                if getattr(backend, "accepts_parents", False):  # (optional: see Backend)
                    results = await backend.store(keys, buffers, parents=parents)  # type: ignore[call-arg]
                else:
                    results = await backend.store(keys, buffers)
            except Exception as exc:  # any failure of a backend: see _backends
                self._calls.observed(tier_backend, "store", started, False)
                tier_backend.failed(exc, trio.current_time(), "store")
                continue
            self._calls.observed(tier_backend, "store", started, True)
            tier_backend.succeeded("store")
            for ok, payload in zip(results, payloads, strict=True):
                tier_backend.count("stores" if ok else "stores_refused")
                tier_backend.count("store_bytes", payload.nbytes if ok else 0)


def _headers(
    keys: Sequence[bytes], fingerprints: Sequence[bytes], payloads: Sequence[memoryview]
) -> list[bytes]:
    """The frame headers of a batch of chunks (in a worker thread)."""
    return [header(k, f, p) for k, f, p in zip(keys, fingerprints, payloads, strict=True)]
