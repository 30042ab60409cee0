"""Pins and reservations as request-scoped leases.

Every pin the server takes on behalf of a client is a :class:`Lease`: it belongs to an engine
request and to the client session that took it, carries a count and an expiry, and is released
exactly once — by the operation that ends it, by the request's end, by its session's end, or by
expiry. The table only keeps the books; whoever removes a lease undoes its effect on the L1 (the
table is storage-agnostic and has no I/O).
"""

from __future__ import annotations

import collections
import enum
import heapq
import itertools
from collections.abc import Callable, Iterable

import attrs

__all__ = ["Lease", "LeaseKind", "LeaseTable"]


class LeaseKind(enum.Enum):
    LOOKUP = "lookup"  # a lookup's pin of a hit chunk, awaiting the ranks' retrieves
    READ = "read"  # a worker copying a chunk out of L1 (retrieve → release)
    WRITE = "write"  # a worker copying a chunk into a reserved slot (store → commit)


@attrs.define(eq=False, slots=True)
class Lease:
    kind: LeaseKind
    request: str
    owner: str
    """Session id of the client that holds it."""
    key: bytes
    count: int
    expires_at: float
    active: bool = True


class LeaseTable:
    """All live leases, indexed by request, by owner and by expiry.

    ``groups_of`` names the groups (say a tenant, a client key) a request counts in, from its
    first lease; :attr:`requests_by_group` counts the requests holding leases per group, and
    :attr:`leases_by_group` their leases.
    """

    def __init__(self, groups_of: Callable[[Lease], tuple[str, ...]] | None = None) -> None:
        self._groups_of = groups_of
        self._request_groups: dict[str, tuple[str, ...]] = {}
        self.requests_by_group: collections.Counter[str] = collections.Counter()
        self.leases_by_group: collections.Counter[str] = collections.Counter()
        self._by_request: dict[str, dict[tuple[LeaseKind, str, bytes], Lease]] = {}
        self._by_owner: dict[str, set[Lease]] = {}
        self._lookups: dict[tuple[str, bytes], Lease] = {}  # (request, key) → LOOKUP lease
        self._expiry: list[tuple[float, int, Lease]] = []
        self._seq = itertools.count()
        self.live = 0
        self.expired_total = 0

    def add(
        self, kind: LeaseKind, request: str, owner: str, key: bytes, count: int, expires_at: float
    ) -> Lease:
        """Record a lease; one per (kind, request, owner, key): adding again adds to its count
        and pushes its expiry back."""
        slot = (kind, owner, key)
        leases = self._by_request.setdefault(request, {})
        lease = leases.get(slot)
        if lease is not None:
            lease.count += count
            lease.expires_at = max(lease.expires_at, expires_at)
        else:
            lease = Lease(kind, request, owner, key, count, expires_at)
            if self._groups_of is not None:
                if not leases:  # the request's first lease
                    self._request_groups[request] = self._groups_of(lease)
                    self.requests_by_group.update(self._request_groups[request])
                self.leases_by_group.update(self._request_groups[request])
            leases[slot] = lease
            self._by_owner.setdefault(owner, set()).add(lease)
            if kind is LeaseKind.LOOKUP:
                self._lookups[(request, key)] = lease
            self.live += 1
        heapq.heappush(self._expiry, (lease.expires_at, next(self._seq), lease))
        return lease

    def get(self, kind: LeaseKind, request: str, owner: str, key: bytes) -> Lease | None:
        leases = self._by_request.get(request)
        return leases.get((kind, owner, key)) if leases else None

    def take_lookup(self, request: str, key: bytes, count: int = 1) -> int:
        """Consume up to ``count`` of the LOOKUP pins ``request`` holds on ``key`` (whoever took
        them); return how many were consumed. A lease whose count reaches 0 is removed."""
        lease = self._lookups.get((request, key))
        if lease is None:
            return 0
        taken = min(count, lease.count)
        lease.count -= taken
        if lease.count == 0:
            self.remove(lease)
        return taken

    def remove(self, lease: Lease) -> None:
        """Forget ``lease`` (idempotent). Its heap entry is dropped lazily."""
        if not lease.active:
            return
        lease.active = False
        self.live -= 1
        leases = self._by_request[lease.request]
        del leases[(lease.kind, lease.owner, lease.key)]
        groups = self._request_groups.get(lease.request, ())
        _subtract(self.leases_by_group, groups)
        if not leases:
            del self._by_request[lease.request]
            self._request_groups.pop(lease.request, None)
            _subtract(self.requests_by_group, groups)
        owned = self._by_owner[lease.owner]
        owned.discard(lease)
        if not owned:
            del self._by_owner[lease.owner]
        if lease.kind is LeaseKind.LOOKUP:
            del self._lookups[(lease.request, lease.key)]
        if len(self._expiry) > 2 * self.live + 1024:  # mostly removed leases: compact, O(1)
            self._expiry = [entry for entry in self._expiry if entry[2].active]  # amortised
            heapq.heapify(self._expiry)

    def pop_request(
        self, request: str, kinds: Iterable[LeaseKind] = tuple(LeaseKind)
    ) -> list[Lease]:
        """Remove and return the leases of ``request`` of the given kinds."""
        wanted = set(kinds)
        leases = [
            lease for lease in self._by_request.get(request, {}).values() if lease.kind in wanted
        ]
        for lease in leases:
            self.remove(lease)
        return leases

    def pop_owner(self, owner: str, limit: int | None = None) -> list[Lease]:
        """Remove and return every lease held by session ``owner`` (at most ``limit`` of
        them: call again for the rest)."""
        owned = self._by_owner.get(owner, ())
        if limit is not None and len(owned) > limit:
            leases = list(itertools.islice(owned, limit))
        else:
            leases = list(owned)
        for lease in leases:
            self.remove(lease)
        return leases

    def pop_expired(self, now: float) -> list[Lease]:
        """Remove and return the leases whose expiry is at or before ``now``."""
        expired = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, _, lease = heapq.heappop(heap)
            if lease.active and lease.expires_at <= now:
                self.remove(lease)
                expired.append(lease)
        self.expired_total += len(expired)
        return expired

    def next_expiry(self) -> float | None:
        """When the earliest lease may expire (None if there is none)."""
        heap = self._expiry
        while heap and not heap[0][2].active:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def owned(self, owner: str) -> int:
        """How many live leases ``owner`` holds (quotas read it on every lease they admit)."""
        return len(self._by_owner.get(owner, ()))

    @property
    def requests(self) -> int:
        """Requests holding at least one lease."""
        return len(self._by_request)

    def holds(self, request: str) -> bool:
        """Whether any lease of ``request`` is live."""
        return request in self._by_request

    def count(self, kind: LeaseKind) -> int:
        return sum(
            1
            for leases in self._by_request.values()
            for lease in leases.values()
            if lease.kind is kind
        )


def _subtract(counter: collections.Counter[str], groups: Iterable[str]) -> None:
    """One less of each of ``groups`` (a group at 0 is removed)."""
    for group in groups:
        counter[group] -= 1
        if counter[group] <= 0:
            del counter[group]
