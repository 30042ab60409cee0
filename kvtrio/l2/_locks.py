"""Local lock counts for backends whose store has no locks of its own (all of ours, so far)."""

from __future__ import annotations

import collections
from collections.abc import Sequence

__all__ = ["LocalLocks"]


class LocalLocks:
    """Per-key lock counts, and deletes deferred until the last unlock.

    The bookkeeping behind ``lookup_and_lock`` / ``unlock`` / ``delete`` for a backend that
    locks in its own process: call :meth:`lock` after the last checkpoint of a lookup, run the
    deletes :meth:`unlock` returns, and ask :meth:`defer_delete` before deleting. A backend whose
    store is answered after the service applied it (a round trip) calls :meth:`storing` before
    and :meth:`stored` after, and runs the deletes :meth:`stored` says are due. Synchronous.
    """

    def __init__(self) -> None:
        self._counts: collections.Counter[bytes] = collections.Counter()
        self._doomed: set[bytes] = set()
        self._storing: collections.Counter[bytes] = collections.Counter()
        """Stores in flight per key."""
        self._after_store: set[bytes] = set()
        """Doomed keys unlocked while a store of them was in flight: deleted only if it fails
        (was: deleted at the unlock, after the service had applied the new object)."""

    def lock(self, keys: Sequence[bytes]) -> None:
        """One more lock on each key."""
        for key in keys:
            self._counts[key] += 1

    def unlock(self, keys: Sequence[bytes]) -> list[bytes]:
        """One lock less on each key (unlocked keys are ignored); return the keys whose delete
        was deferred and is due now."""
        due = []
        for key in keys:
            count = self._counts.get(key, 0)
            if count > 1:
                self._counts[key] = count - 1
            elif count == 1:
                del self._counts[key]
                if key in self._doomed and key in self._storing:
                    self._after_store.add(key)  # (still doomed: lookups do not find it)
                elif key in self._doomed:
                    self._doomed.discard(key)
                    due.append(key)
        return due

    def storing(self, keys: Sequence[bytes]) -> None:
        """A store of ``keys`` starts (its answer may come after the service applied it)."""
        for key in keys:
            self._storing[key] += 1

    def stored(self, key: bytes, ok: bool) -> bool:
        """A store of ``key`` ended; ``ok``: its new object is there (a pending delete was for
        the old one). True if the key's deferred delete is due now: the store failed, and the
        key's last unlock came while stores of it were in flight, none left."""
        if self._storing[key] > 1:
            self._storing[key] -= 1
        else:
            del self._storing[key]
        if ok:
            self.replaced(key)
            return False
        if key in self._after_store and key not in self._storing:
            self._after_store.discard(key)
            self._doomed.discard(key)
            return True
        return False

    def is_locked(self, key: bytes) -> bool:
        return key in self._counts

    def defer_delete(self, key: bytes) -> bool:
        """If ``key`` is locked, remember to delete it at its last unlock and return True."""
        if key in self._counts:
            self._doomed.add(key)
            return True
        return False

    def is_doomed(self, key: bytes) -> bool:
        """Deleted while locked: lookups must not find it any more (loads still may)."""
        return key in self._doomed

    def replaced(self, key: bytes) -> None:
        """A new object was stored under ``key``: a pending delete was for the old one."""
        self._doomed.discard(key)
        self._after_store.discard(key)

    @property
    def total(self) -> int:
        """Locks held, over all keys (the ``locks`` statistic)."""
        return sum(self._counts.values())

    @property
    def locked_keys(self) -> int:
        return len(self._counts)

    @property
    def deferred_deletes(self) -> int:
        return len(self._doomed)
