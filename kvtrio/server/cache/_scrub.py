"""Zeroing a store's slots (``scrub``): a slot handed out for a store and committed without
being written (a faulty or hostile worker) holds zeros, never the bytes of the chunk that lived
there before (another prompt's KV, possibly another tenant's). Used by the host copy path."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ...shm import SharedArena
from ...storage import Entry

__all__ = ["INLINE_SCRUB_BYTES", "Scrubber", "zero"]

INLINE_SCRUB_BYTES = 4 << 20
"""Up to this many bytes per store are zeroed in the trio thread (~45 GB/s here: < 100 µs)."""


class Scrubber:
    """Zeroes the slots of one server's stores; larger stores in a worker thread, one store at
    a time (its own limiter: servers in one process do not wait for each other)."""

    def __init__(self, arena: SharedArena) -> None:
        self._arena = arena
        self._limiter = trio.CapacityLimiter(1)

    def now(self, entries: Sequence[Entry]) -> bool:
        """Zero the slots now if they are few enough for the trio thread; False (nothing done)
        if they must be zeroed with :meth:`in_thread`."""
        if sum(entry.nbytes for entry in entries) > INLINE_SCRUB_BYTES:
            return False
        zero(self._arena, entries)
        return True

    async def in_thread(self, entries: Sequence[Entry]) -> None:
        """Zero the slots, in a worker thread if there are many bytes.

        Cancellation: a zeroing that started in a thread finishes (the slots are never left
        half-zeroed for a later store); the caller's reservations stay leased and are undone as
        usual.
        """
        if self.now(entries):
            return
        await trio.to_thread.run_sync(zero, self._arena, entries, limiter=self._limiter)


def zero(arena: SharedArena, entries: Sequence[Entry]) -> None:
    """Fill the entries' slots with zeros."""
    for entry in entries:
        arena.view(entry.offset, entry.nbytes).fill(0)
