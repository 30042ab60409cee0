"""The L1 index: which chunk lives in which arena slot, in which state, pinned how often.

Synchronous and free of I/O: the server calls it from its event loop. Capacity is a hard bound
(the arena's size); room is made on demand by evicting ready, unpinned chunks in the order the
eviction policy gives. A chunk being written is invisible to lookups until it is committed, and a
pinned chunk is never evicted.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import attrs

from ._allocator import ExtentAllocator
from ._eviction import EvictionPolicy
from ._policies import DEFAULT_EVICTION, make_policy

__all__ = ["Entry", "EntryState", "L1Cache", "L1Listener", "L1Stats", "Reservation"]


class L1Listener(Protocol):
    """Told when a chunk becomes readable in L1 and when a readable one leaves it (the
    server's KV events). Called synchronously from the index; must not call back into it."""

    def ready(self, key: bytes, parent: bytes | None) -> None: ...

    def removed(self, key: bytes) -> None: ...


class EntryState(enum.Enum):
    WRITING = "writing"
    READY = "ready"


@attrs.define(slots=True, eq=False)
class Entry:
    key: bytes
    offset: int
    nbytes: int
    state: EntryState
    pins: int = 0
    parent: bytes | None = None  # the chunk before this one in its prompt, if known


class Reservation(enum.Enum):
    """Why :meth:`L1Cache.reserve` did not hand out a slot."""

    PRESENT = "present"  # the chunk is already stored (ready): nothing to write
    IN_PROGRESS = "in_progress"  # someone else is writing it right now
    NO_SPACE = "no_space"  # not even evicting everything evictable makes room


@attrs.frozen
class L1Stats:
    capacity_bytes: int
    used_bytes: int
    entries: int
    ready: int
    writing: int
    pinned_entries: int
    pins: int
    evictions: int
    store_failures: int


class L1Cache:
    """Index and allocator of the L1 arena. See the module docstring for the rules."""

    def __init__(
        self,
        capacity: int,
        *,
        policy: EvictionPolicy | None = None,
        alignment: int = 4096,
        base: int = 0,
        listener: L1Listener | None = None,
    ) -> None:
        self._allocator = ExtentAllocator(capacity, alignment, base)
        self._policy: EvictionPolicy = (
            policy if policy is not None else make_policy(DEFAULT_EVICTION)
        )
        self._entries: dict[bytes, Entry] = {}
        self._pins = 0
        self._pinned_entries = 0
        self._writing = 0
        self._evictable_bytes = 0
        self._quarantine: list[tuple[float, int, int]] = []  # (until, offset, nbytes)
        self.evictions = 0
        self.store_failures = 0
        self.listener = listener
        """Told of chunks becoming readable and of readable ones leaving (KV events)."""

    @property
    def capacity(self) -> int:
        return self._allocator.size

    def index_for(self, key: bytes) -> L1Cache:
        """The index that holds ``key``: this one (a server's per-tenant L1 has several)."""
        return self

    def entry_keys(self) -> list[bytes]:
        """The keys of every entry (ready or being written), in no particular order."""
        return list(self._entries)

    # ----------------------------------------------------------------- reading

    def get(self, key: bytes) -> Entry | None:
        """The ready entry of ``key``, or None (missing or still being written)."""
        entry = self._entries.get(key)
        return entry if entry is not None and entry.state is EntryState.READY else None

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are ready; they count as used, the last first
        (so that a recency order keeps a prompt's head longest)."""
        entries = self._entries
        ready = EntryState.READY
        count = 0
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.state is not ready:
                break
            count += 1
        touch = self._policy.touch
        for index in range(count - 1, -1, -1):
            touch(keys[index])
        return count

    # ----------------------------------------------------------------- pins

    def pin(self, key: bytes, count: int = 1) -> Entry:
        """Pin the ready entry of ``key`` ``count`` times (it cannot be evicted until unpinned).

        Raises ``KeyError`` if it is not ready, ``ValueError`` if ``count`` is below 1 (a pin
        count never goes down here: only :meth:`unpin` takes pins away).
        """
        if count < 1:
            raise ValueError(f"pinning {count} times: a pin count is at least 1")
        entry = self.get(key)
        if entry is None:
            raise KeyError(key)
        if entry.pins == 0:
            self._unevictable(entry, held=True)
            self._pinned_entries += 1
        entry.pins += count
        self._pins += count
        return entry

    def unpin(self, key: bytes, count: int = 1) -> None:
        """Undo ``count`` pins; an entry with no pins left becomes evictable again.
        ``ValueError`` if ``count`` is negative or more than it holds (0 does nothing)."""
        entry = self._entries[key]
        if not 0 <= count <= entry.pins:
            raise ValueError(f"unpinning {count} of {entry.pins} pins")
        if not count:
            return
        entry.pins -= count
        self._pins -= count
        if entry.pins == 0:
            self._pinned_entries -= 1
            self._evictable(entry)

    # ----------------------------------------------------------------- writing

    def reserve(
        self, key: bytes, nbytes: int, *, parent: bytes | None = None
    ) -> Entry | Reservation:
        """A slot of ``nbytes`` for writing ``key``, evicting as needed; or why there is none.

        ``parent`` is the chunk before ``key`` in its prompt (None for the first), for the
        eviction policy.

        The entry is in state WRITING (invisible to :meth:`get`/:meth:`prefix`) until
        :meth:`commit`, or gone after :meth:`abort`.
        """
        existing = self._entries.get(key)
        if existing is not None:
            if existing.state is EntryState.READY:
                self._policy.touch(key)
                return Reservation.PRESENT
            return Reservation.IN_PROGRESS
        offset = self._allocate(nbytes)
        if offset is None:
            self.store_failures += 1
            return Reservation.NO_SPACE
        entry = Entry(key, offset, nbytes, EntryState.WRITING, parent=parent)
        self._entries[key] = entry
        self._writing += 1
        return entry

    def commit(self, key: bytes) -> None:
        """Make a written entry visible (ready, unpinned, most recently used)."""
        entry = self._entries[key]
        if entry.state is not EntryState.WRITING:
            raise ValueError("the entry is not being written")
        entry.state = EntryState.READY
        self._writing -= 1
        self._evictable(entry)
        if self.listener is not None:
            self.listener.ready(key, entry.parent)

    def abort(self, key: bytes) -> None:
        """Drop an entry being written; its slot is free again."""
        entry = self._entries[key]
        if entry.state is not EntryState.WRITING:
            raise ValueError("the entry is not being written")
        self._writing -= 1
        self._drop(entry)

    def abort_quarantined(self, key: bytes, until: float) -> None:
        """Drop an entry being written by a writer that may still be writing (its reservation
        expired, or its session vanished): the entry disappears now, but its slot is reused only
        after ``until`` (see :meth:`release_quarantine`), so a late write lands nowhere that
        matters."""
        entry = self._entries[key]
        if entry.state is not EntryState.WRITING:
            raise ValueError("the entry is not being written")
        self._writing -= 1
        del self._entries[key]
        self._quarantine.append((until, entry.offset, entry.nbytes))

    def release_quarantine(self, now: float) -> int:
        """Free the quarantined slots whose time has come; return how many."""
        due = [q for q in self._quarantine if q[0] <= now]
        if due:
            self._quarantine = [q for q in self._quarantine if q[0] > now]
            for _, offset, nbytes in due:
                self._allocator.free(offset, nbytes)
        return len(due)

    def next_quarantine_release(self) -> float | None:
        return min((q[0] for q in self._quarantine), default=None)

    def discard(self, key: bytes) -> bool:
        """Drop a ready, unpinned entry (e.g. found corrupt); False if it cannot be dropped."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not EntryState.READY or entry.pins:
            return False
        self._unevictable(entry)
        self._drop(entry)
        if self.listener is not None:
            self.listener.removed(key)
        return True

    # ----------------------------------------------------------------- internals

    def _allocate(self, nbytes: int) -> int | None:
        allocator = self._allocator
        offset = allocator.allocate(nbytes)
        if offset is not None:
            return offset
        if allocator.free_bytes + self._evictable_bytes < allocator.round(nbytes):
            return None  # evicting everything evictable would not make room: evict nothing
        for victim in self._policy.victims():
            entry = self._entries[victim]
            self._unevictable(entry)
            self._drop(entry)
            self.evictions += 1
            if self.listener is not None:
                self.listener.removed(victim)
            offset = allocator.allocate(nbytes)
            if offset is not None:
                return offset
        return None

    def _evictable(self, entry: Entry) -> None:
        self._policy.add(entry.key, entry.parent)
        self._evictable_bytes += self._allocator.round(entry.nbytes)

    def _unevictable(self, entry: Entry, *, held: bool = False) -> None:
        if held:
            self._policy.hold(entry.key)
        else:
            self._policy.discard(entry.key)
        self._evictable_bytes -= self._allocator.round(entry.nbytes)

    def _drop(self, entry: Entry) -> None:
        del self._entries[entry.key]
        self._allocator.free(entry.offset, entry.nbytes)

    def stats(self) -> L1Stats:
        return L1Stats(
            capacity_bytes=self.capacity,
            used_bytes=self.capacity - self._allocator.free_bytes,
            entries=len(self._entries),
            ready=len(self._entries) - self._writing,
            writing=self._writing,
            pinned_entries=self._pinned_entries,
            pins=self._pins,
            evictions=self.evictions,
            store_failures=self.store_failures,
        )
