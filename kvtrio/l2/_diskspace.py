"""The disk backend's room: capacity, the bytes of each owner (tenant), and whom to evict.

Pure state, no I/O: the backend calls it between checkpoints. Bytes are counted as they lie
on disk (a record's aligned size, header included), so ``capacity`` bounds the files.

**Owners.** Every object is stored for an owner (a tenant's tag; ``b""`` when the caller did
not say). Each owner has its own eviction policy, and room is made by evicting from the owner
that holds the most bytes (the storing owner counted with what it is storing): a tenant that
floods the L2 evicts its own objects once it holds more than the others, so no tenant is pushed
below ``capacity / owners`` by another (max-min fairness). ``share`` (a fraction, 1.0 by
default) also caps what one owner may hold: a store beyond it evicts that owner's own objects.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

from ..storage import EvictionPolicy

__all__ = ["PolicyFactory", "Room"]

PolicyFactory = Callable[[], EvictionPolicy]
"""Makes a new owner's eviction policy."""

_RESERVE = 0.02
"""Fraction of the filesystem kept free: capacity never counts on the last 2% of it."""


class Room:
    """Capacity, bytes per owner, and one eviction policy per owner over its unlocked
    objects. The backend tells it what is indexed (:meth:`indexed`, :meth:`forgotten`) and
    what may be evicted (:meth:`add`, :meth:`hold`), and asks it for :meth:`victims`."""

    def __init__(self, make_policy: PolicyFactory, share: float, capacity: int) -> None:
        """``capacity``: the option (:meth:`measured` lowers it to what the filesystem holds)."""
        if not 0 < share <= 1:
            raise ValueError("tenant_share must be a fraction in (0, 1]")
        self._make_policy = make_policy
        self.share = share
        self.bytes = 0
        """Bytes on disk of the indexed objects, and of the records being written."""
        self.capacity = capacity
        self._limited = False  # whether the filesystem bounds the capacity (said once)
        self._owner_of: dict[bytes, bytes] = {}
        self._bytes_of = collections.Counter[bytes]()
        self._policies: dict[bytes, EvictionPolicy] = {}

    def measured(self, free: int, total: int, option: int) -> str | None:
        """Set the capacity from the filesystem's free and total bytes (measured with our
        bytes on it): the option, or what fits less a 2% reserve. A filesystem that reports no
        size (ramfs: 0 blocks) leaves it at the option (or lower, after a full filesystem).
        Returns a line to log when the filesystem starts to bound it, else None."""
        if total <= 0:
            self.capacity = min(option, self.capacity)
            said, self._limited = self._limited, True
            return (
                None
                if said
                else (
                    f"the filesystem reports no size (ramfs?); only capacity={option} bounds the "
                    "objects, and a full filesystem is found by failed writes"
                )
            )
        fits = max(self.bytes + free - int(total * _RESERVE), 0)
        self.capacity = min(option, fits)
        was, self._limited = self._limited, self.capacity < option
        if self._limited and not was:
            return f"the filesystem holds {self.capacity} bytes for objects, less than capacity"
        return None

    # ----------------------------------------------------------------- what is there

    def indexed(self, key: bytes, owner: bytes, size: int) -> None:
        """``key`` (not indexed now) is on disk for ``owner``, ``size`` bytes."""
        self._owner_of[key] = owner
        self._bytes_of[owner] += size
        self.bytes += size

    def forgotten(self, key: bytes, size: int) -> None:
        """``key`` (``size`` bytes) is no longer indexed: out of its owner's policy too."""
        owner = self._owner_of.pop(key, b"")
        self._bytes_of[owner] -= size
        if not self._bytes_of[owner]:
            del self._bytes_of[owner]
        self.bytes -= size
        policy = self._policies.get(owner)
        if policy is not None:
            policy.discard(key)

    def reserve(self, owner: bytes, size: int) -> None:
        """Count ``size`` bytes being written for ``owner`` (undone by :meth:`unreserve`)."""
        self._bytes_of[owner] += size
        self.bytes += size

    def unreserve(self, owner: bytes, size: int) -> None:
        self._bytes_of[owner] -= size
        if not self._bytes_of[owner]:
            del self._bytes_of[owner]
        self.bytes -= size

    def owner_bytes(self, owner: bytes) -> int:
        return self._bytes_of[owner]

    @property
    def owners(self) -> int:
        """Owners with bytes on disk."""
        return len(self._bytes_of)

    # ----------------------------------------------------------------- eviction order

    def _policy(self, key: bytes) -> EvictionPolicy | None:
        owner = self._owner_of.get(key)
        return None if owner is None else self._policies.get(owner)

    def add(self, key: bytes, parent: bytes | None = None) -> None:
        """``key`` (indexed) may be evicted (see ``EvictionPolicy.add``)."""
        owner = self._owner_of[key]
        policy = self._policies.get(owner)
        if policy is None:
            policy = self._policies[owner] = self._make_policy()
        policy.add(key, parent)

    def hold(self, key: bytes) -> None:
        policy = self._policy(key)
        if policy is not None:
            policy.hold(key)

    def touch(self, key: bytes) -> None:
        policy = self._policy(key)
        if policy is not None:
            policy.touch(key)

    def cap(self) -> int:
        """The most bytes one owner may hold."""
        return int(self.capacity * self.share)

    def fits(self, owner: bytes, size: int) -> bool:
        """Whether ``size`` more bytes for ``owner`` fit the capacity and its cap."""
        return self.bytes + size <= self.capacity and self._bytes_of[owner] + size <= self.cap()

    def victims(self, owner: bytes, size: int) -> Iterator[bytes]:
        """Evictable keys until ``size`` bytes for ``owner`` fit, first to go first: ``owner``'s
        own while it is over its cap, else the largest owner's (``owner`` counted with
        ``size``; on a tie, ``owner`` itself). The caller forgets each key it evicts."""
        running: dict[bytes, Iterator[bytes]] = {}
        cap = self.cap()
        while not self.fits(owner, size):
            policy = self._policies.get(owner)
            if self._bytes_of[owner] + size > cap:
                chosen = owner if policy is not None and len(policy) else None
            else:
                candidates = [o for o, p in self._policies.items() if len(p)]
                chosen = max(
                    candidates,
                    key=lambda o: (self._bytes_of[o] + (size if o == owner else 0), o == owner),
                    default=None,
                )
            if chosen is None:
                return
            victims = running.get(chosen)
            if victims is None:
                victims = running[chosen] = self._policies[chosen].victims()
            key = next(victims, None)
            if key is None:
                return
            yield key
