"""Prefetch: L2 hits of a lookup are loaded into L1 right away, before the retrieve asks.

Each load gets a reserved L1 slot and a loader task (in the L2 tier's loaders nursery). When it
ends, the chunk is committed and pinned for the request like an L1 hit, or its slot is dropped.
A retrieve waits for the loads of its chunks; a request's end, or the end of the session that
looked it up, cancels them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import trio

from ...storage import Entry, Reservation
from ..l2tier import L2Tier, Load, TierBackend
from ._core import CacheCore
from ._keys import RequestKey

__all__ = ["Prefetcher"]


class Prefetcher:
    """The L2 → L1 loads the lookups started, by request and by the session that owns them."""

    def __init__(self, core: CacheCore, l2: L2Tier) -> None:
        """The loads land in ``core``'s L1 and are pinned there (calls down, never back)."""
        self.l1 = core.l1
        self.l2 = l2
        self.config = core.config
        self._pin = core.pin_for_lookup
        self._loads: dict[RequestKey, dict[bytes, Load]] = {}  # request → object key → load
        self._count = 0
        self._by_owner: dict[str, set[tuple[RequestKey, bytes]]] = {}
        self._per_request: collections.Counter[RequestKey] = collections.Counter()  # unfinished
        self._waits: dict[RequestKey, dict[bytes, float]] = {}  # request → namespace → deadline
        self.failed = 0

    @property
    def pending_count(self) -> int:
        return self._count

    def pending(self, request: RequestKey, object_keys: Sequence[bytes]) -> list[Load]:
        """The unfinished loads of these objects for ``request``."""
        loads = self._loads.get(request)
        if not loads:
            return []
        return [load for k in object_keys if (load := loads.get(k)) is not None]

    def wait_deadline(self, request: RequestKey, space: bytes, proposed: float) -> float:
        """Until when the retrieves of ``request`` into namespace ``space`` wait for its
        loads: ``proposed`` for the first one that waits; those after it share that deadline
        while any load of the request is unfinished (a new lookup of the request starts over).
        """
        return self._waits.setdefault(request, {}).setdefault(space, proposed)

    def deadline(self, request: RequestKey, space: bytes) -> float | None:
        """The deadline :meth:`wait_deadline` set, if a retrieve has waited."""
        return self._waits.get(request, {}).get(space)

    def cancel_request(self, request: RequestKey) -> None:
        """Cancel the request's loads (its own only: no scan of the others')."""
        self._waits.pop(request, None)
        for load in self._loads.get(request, {}).values():
            load.scope.cancel()

    def cancel_owner(self, owner: str) -> None:
        for request, object_key in self._by_owner.pop(owner, ()):
            load = self._loads.get(request, {}).get(object_key)
            if load is not None:
                load.scope.cancel()

    async def start(
        self,
        owner: str,
        request: RequestKey,
        spaces: Sequence[bytes],
        hashes: Sequence[bytes],
        sources: Sequence[Sequence[TierBackend]],
        readers: int,
        fingerprint: bytes,
        chunk_bytes: int,
    ) -> int:
        """Reserve L1 slots for the chunks found in L2 and start their loads; return how many
        leading chunks will be (or already are) in L1. From the first chunk that cannot be
        placed on, chunks are unlocked in L2 and not counted.

        The loads are started in batches, one per source backend (see
        :meth:`Loads.start_loads`). Slots are reserved and loads started with no checkpoint in
        between (a cancellation cannot strand a reservation); unlocking what will not be loaded
        comes last (shielded).
        """
        placed = 0
        release: tuple[list[list[TierBackend]], list[list[bytes]]] = ([], [])
        by_source: dict[int, tuple[TierBackend, list[tuple[bytes, Entry]]]] = {}
        expires = trio.current_time() + self.config.pin_ttl
        for index, (chunk_hash, chunk_sources) in enumerate(zip(hashes, sources, strict=True)):
            keys = [space + chunk_hash for space in spaces]
            outcomes = [self.l1.reserve(k, chunk_bytes) for k in keys]
            if any(o in (Reservation.NO_SPACE, Reservation.IN_PROGRESS) for o in outcomes):
                for object_key, outcome in zip(keys, outcomes, strict=True):
                    if isinstance(outcome, Entry):
                        self.l1.abort(object_key)
                release[0].extend(list(s) for s in sources[index:])
                release[1].extend([space + h for space in spaces] for h in hashes[index:])
                break
            for object_key, outcome, source in zip(keys, outcomes, chunk_sources, strict=True):
                if outcome is Reservation.PRESENT:  # it reached L1 meanwhile
                    self._pin(request, owner, object_key, readers, expires)
                    release[0].append([source])
                    release[1].append([object_key])
                elif isinstance(outcome, Entry):
                    by_source.setdefault(id(source), (source, []))[1].append((object_key, outcome))
            placed += 1
        done = self._done(request, owner, readers)
        owned = self._by_owner.setdefault(owner, set()) if by_source else set()
        loads = self._loads.setdefault(request, {}) if by_source else {}
        for source, items in by_source.values():
            for load in self.l2.loads.start_loads(items, source, fingerprint, done):
                if load.key not in loads:
                    self._count += 1
                loads[load.key] = load
                self._per_request[request] += 1
                owned.add((request, load.key))
        if release[0]:
            await self.l2.loads.release(*release)
        return placed

    def _done(self, request: RequestKey, owner: str, readers: int) -> Callable[[Load], None]:
        def done(load: Load) -> None:
            loads = self._loads.get(request)
            if loads is not None and loads.pop(load.key, None) is not None:
                self._count -= 1
                if not loads:
                    del self._loads[request]
            self._per_request[request] -= 1
            if self._per_request[request] <= 0:
                del self._per_request[request]
                self._waits.pop(request, None)
            owned = self._by_owner.get(owner)
            if owned is not None:
                owned.discard((request, load.key))
            if load.ok and not load.scope.cancel_called:
                self.l1.commit(load.key)
                expires = trio.current_time() + self.config.pin_ttl
                self._pin(request, owner, load.key, readers, expires)
            elif load.scope.cancel_called:
                # Our copy thread has finished, but a plugin backend might abandon its thread:
                # keep the slot out of use for a while, as for any writer that may be late.
                until = trio.current_time() + self.config.reservation_ttl
                self.l1.abort_quarantined(load.key, until)
            else:
                self.failed += 1
                self.l1.abort(load.key)

        return done
