"""Hits served from L1, passed on to the backends' eviction policies in batches.

A chunk served from L1 is never looked up in L2, so without this a backend with an eviction
policy of its own (``disk``) would see a hot prompt as stored once and never used: the first
thing to evict, and lost at a restart. The cache reports the keys of its L1 hits
(:meth:`Touches.add`: synchronous, O(keys), no I/O); they wait in a bounded ordered set (a key
used again moves to its end, so the last used is touched last) and one task sends them to every
usable backend that declares ``accepts_touches``, one ``touch`` call per backend and batch:
when :data:`BATCH` keys wait, or :data:`INTERVAL` seconds after the last send. When
:data:`PENDING` keys wait, further new keys are dropped and counted (``touches_dropped``): the
set never grows without bound. A failing ``touch`` is a backend failure like any other
(``_backends``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import trio

from ._backends import Calls, TierBackend

__all__ = ["BATCH", "INTERVAL", "PENDING", "Touches"]

BATCH = 1024
"""Keys per ``touch`` call; this many waiting keys are sent at once."""
PENDING = 8192
"""Keys that may wait at most; beyond, new ones are dropped (counted)."""
INTERVAL = 0.5
"""Seconds waiting keys wait at most for a send."""


class Touches:
    """The L1 hits waiting to be sent to the backends that take them."""

    def __init__(
        self,
        backends: Sequence[TierBackend],
        calls: Calls,
        *,
        batch: int = BATCH,
        pending: int = PENDING,
        interval: float = INTERVAL,
    ) -> None:
        self.targets = [b for b in backends if b.capabilities.touches]
        """The backends that take touches (an optional capability: see ``kvtrio.l2``)."""
        self._calls = calls
        self._batch, self._limit, self._interval = batch, pending, interval
        self._pending: dict[bytes, None] = {}  # (ordered: the last used last)
        self._ready = trio.Event()  # set when a batch is waiting
        self.dropped = 0

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def add(self, keys: Iterable[bytes]) -> None:
        """``keys`` were used (L1 hits), in that order. Synchronous; no I/O. A key already
        waiting moves to the end; a new key finding :data:`PENDING` keys waiting is dropped."""
        if not self.targets:
            return
        pending, dropped = self._pending, 0
        for key in keys:
            # (a key that was waiting moves to the end; a new one needs room)
            if pending.pop(key, 0) is None or len(pending) < self._limit:
                pending[key] = None
            else:
                dropped += 1
        if dropped:
            self.dropped += dropped
            for target in self.targets:
                target.count("touches_dropped", dropped)
        if len(pending) >= self._batch:
            self._ready.set()

    async def run(self) -> None:
        """Send the waiting keys, a batch at a time, until cancelled (see the module doc).

        Cancellation: the keys still waiting are not sent (a touch is a hint: nothing to undo);
        a ``touch`` call under way is cancelled like any backend call.
        """
        if not self.targets:
            return
        while True:
            with trio.move_on_after(self._interval):
                await self._ready.wait()
            self._ready = trio.Event()
            while self._pending:
                keys = list(itertools.islice(self._pending, self._batch))
                for key in keys:
                    del self._pending[key]
                await self._send(keys)

    async def _send(self, keys: list[bytes]) -> None:
        """One ``touch`` of ``keys`` per usable target, one after another. Cancellation: as the
        backend's ``touch``."""
        for target in self.targets:
            if target.usable(trio.current_time()):
                await self._calls.touch(target, keys)
            else:
                target.count("touches_dropped", len(keys))
