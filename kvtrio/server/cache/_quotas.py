"""Quotas on what clients may hold in L1: readers per pin, leases per session and per key, and
a share of L1 that leases (pins and reservations) can never take.

Every pin or reservation is a lease of the cache service's ``LeaseTable``; the quotas count
them there (no second bookkeeping that could drift) and refuse, with ``quota_exceeded``, a
request whose new leases would go beyond a limit. Nothing is held when the error is raised:
the cache core asks before it pins or reserves anything. No I/O (zeroing a store's slots is
``_scrub``'s).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ...errors import ErrorCode, RequestError
from ...storage import L1Cache, LeaseTable

if TYPE_CHECKING:
    from ...config import ServerConfig

__all__ = ["Quotas"]


class Quotas:
    """The limits of one server (from its config) over its lease table."""

    def __init__(self, config: ServerConfig, leases: LeaseTable, l1: L1Cache) -> None:
        self._l1 = l1
        self._leases = leases
        self.max_per_session = config.max_leases_per_session
        self.share = config.lease_share
        self.share_per_key = config.lease_share_per_key
        self._capacity = l1.capacity
        self.refused = 0
        """Requests refused with ``quota_exceeded`` (for stats)."""

    def readers(self, num_readers: int, world_size: int) -> None:
        """A lookup may pin an object for at most ``world_size`` readers (every rank once), and
        never for fewer than none: 0 means the default, a negative count is ``bad_request``
        (the codec refuses it first; this is the line behind it: a count of -3 once unpinned
        other engines' chunks, issue 32)."""
        if type(num_readers) is not int or num_readers < 0:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"num_readers must be in 0…{world_size} (0: the default), got {num_readers!r}",
            )
        if num_readers > world_size:
            self._refuse(
                f"num_readers {num_readers} is more than the registration's world size {world_size}"
            )

    def admit(
        self, owner: str, user: str, new: int, chunk_bytes: int, user_owners: Iterable[str] = ()
    ) -> None:
        """Refuse (``quota_exceeded``) ``new`` more pins or reservations of ``chunk_bytes``
        each for the session ``owner`` of client key ``user`` if they would exceed its
        session's limit or its key's share of L1 (CURVE keys: one key cannot starve the
        others); ``user_owners``: the key's other sessions that may hold leases."""
        if new <= 0:
            return
        leases = self._leases
        held = leases.owned(owner)
        if held + new > self.max_per_session:
            self._refuse(
                f"this session holds {held} pins/reservations; {new} more would exceed its "
                f"limit of {self.max_per_session}: release some (end finished requests)"
            )
        if user:
            mine = held + sum(leases.owned(other) for other in user_owners if other != owner)
            if (mine + new) * chunk_bytes > self.share_per_key * self._capacity:
                self._refuse(
                    f"this client key's pins and reservations may take {self.share_per_key:.0%} "
                    "of L1, which is reached: release some, or retry later"
                )

    def admit_pins(self, keys: Sequence[bytes], chunk_bytes: int) -> None:
        """Refuse pinning the L1 entries ``keys`` if the entries pinned or being written would
        then take more than the share of L1 that stays evictable (entries pinned already cost
        nothing more). Reservations are not checked here: L1 bounds them itself (no room: the
        slot comes back ``failed``)."""
        l1 = self._l1
        fresh = 0
        for key in keys:
            entry = l1.get(key)
            if entry is not None and entry.pins == 0:
                fresh += entry.nbytes
        if not fresh:
            return
        stats = l1.index_for(keys[0]).stats()  # the share of the tenant's own arena
        held = (stats.pinned_entries + stats.writing) * chunk_bytes
        if held + fresh > self.share * self._capacity:
            self._refuse(
                f"pins and reservations may take {self.share:.0%} of L1, which is reached; "
                "retry later"
            )

    def _refuse(self, message: str) -> None:
        self.refused += 1
        raise RequestError(ErrorCode.QUOTA_EXCEEDED, message)
