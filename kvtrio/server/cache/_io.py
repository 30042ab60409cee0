"""What the cache operations do around the core: sessions, turns, the L2 tier, the loads.

:class:`CacheIO` is what the handlers (``_lookups``, ``_writes``, ``_reads``,
``_registrations``) share above the I/O-free :class:`~._core.CacheCore`: the L2 tier (a
commit's :class:`~._core.L2Write` s go to its write-behind, an L1 hit's keys to its touches),
the L2 → L1 loads (``_prefetch``, which pins through the core), the completions of server-side
copies, the KV events' announcer, the turns of big messages, and the sessions' ends (which
release what the core holds for them). Calls go down only: the core never calls back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import trio

from ..._logging import event
from ...config import ServerConfig
from ...protocol import Retrieve, Store
from .._session import Session
from ..l2tier import L2Tier
from ._core import RELEASE_SLICE, CacheCore, L2Write
from ._keys import RequestKey, WriteEnd
from ._prefetch import Prefetcher

__all__ = ["CacheIO", "ChunkNaming"]

log = logging.getLogger("kvtrio.cache")


class ChunkNaming(Protocol):
    """What the cache tells the KV events' announcer (``server._announce.Announcer``): the
    names a store carried, and which namespaces are announced. Synchronous, no I/O."""

    def names(
        self,
        keys: Sequence[bytes],
        block_hashes: Sequence[int | bytes],
        block_size: int,
        store: Store | Retrieve | None = None,
    ) -> None: ...

    def announce_space(self, space: bytes, tenant: str) -> None: ...


class CacheIO:
    """The core of one server with its L2 tier, loads, copies' completions and announcer."""

    def __init__(
        self,
        core: CacheCore,
        l2: L2Tier,
        *,
        settle_copies: Callable[[], None] = lambda: None,
        announcer: ChunkNaming | None = None,
    ) -> None:
        self.core = core
        self.config: ServerConfig = core.config
        self.l2 = l2
        self.settle_copies = settle_copies
        """Run the completions of server-side copies that have already finished (non-blocking):
        called first by the operations that read the cache, so a copy the worker saw done is
        visible to its next request."""
        self.announcer = announcer
        """The KV events' announcer (``--events``), if any."""
        self.prefetch = Prefetcher(core, l2)
        self._watched: set[str] = set()  # sessions whose end releases their leases
        self._slices = trio.CapacityLimiter(1)
        """The turn to run one slice of a big message's work (see :meth:`turn`)."""

    async def turn(self) -> None:
        """Yield to the event loop, then wait for this task's turn to run the next slice of
        a big message's work. Turns go one task at a time, first come first served, so that
        many big messages at once still run about one slice per scheduling round, not one
        each (trio runs every runnable task before it polls the sockets again). Cancellation:
        raises Cancelled (the caller's slices so far stay done)."""
        async with self._slices:
            pass

    # ----------------------------------------------------------------- L2 side of L1 steps

    def touched(self, spaces: Sequence[bytes], hashes: Sequence[bytes]) -> None:
        """L1 hits are uses in L2's policies too (the head last), and rewritten to L2 if they
        never reached it."""
        if hashes and self.l2.enabled:
            self.l2.touches.add(space + h for h in reversed(hashes) for space in spaces)
            self.l2.writes.rewrite(space + h for h in hashes for space in spaces)

    def write_behind(self, writes: Sequence[L2Write], written: list[trio.Event] | None) -> None:
        """Queue committed chunks for L2; with write-through, each chunk's L2-written event is
        appended to ``written``."""
        for write in writes:
            done = self.l2.writes.commit(write.key, write.fingerprint, write.tenant)
            if done is not None and written is not None:
                written.append(done)

    def end_write(
        self, owner: str, request: RequestKey, object_key: bytes, how: WriteEnd, fingerprint: bytes
    ) -> bool:
        """The core's :meth:`~._core.CacheCore.end_write`, a commit queued for L2 (for a copy
        path that copies on the server: ``_copy.LeaseEnds``)."""
        writes: list[L2Write] = []
        ended = self.core.end_write(owner, request, object_key, how, fingerprint, writes)
        self.write_behind(writes, None)
        return ended

    def end_reads(self, owner: str, request: RequestKey, object_keys: Sequence[bytes]) -> int:
        """The core's :meth:`~._core.CacheCore.end_reads` (``_copy.LeaseEnds``)."""
        return self.core.end_reads(owner, request, object_keys)

    def end_lookup(self, request: RequestKey) -> int:
        """Cancel the request's loads and release its lookup pins; how many pins."""
        self.prefetch.cancel_request(request)
        return self.core.end_lookup(request)

    # ----------------------------------------------------------------- sessions

    def watch(self, session: Session) -> None:
        """Make the session's end release everything it holds (once per session)."""
        if session.id in self._watched:
            return
        self._watched.add(session.id)
        self.core.enter(session)

        async def session_ended() -> None:
            self._watched.discard(session.id)
            self.core.leave(session.id)
            # The client may still be alive (silent, not dead): a late write must land in a
            # quarantined slot, never in one handed to someone else.
            await self.release_session(session.id, quarantine=True)

        session.add_cleanup(session_ended)

    async def release_session(self, session_id: str, *, quarantine: bool) -> int:
        """Drop the session's registration (if any) and every lease it holds; cancel the loads
        it started. Returns how many leases were released.

        The leases go :data:`~._core.RELEASE_SLICE` at a time, taking turns (:meth:`turn`) in
        between (a session holding 100k pins took ~0.4 s of the loop to end). Cancellation: at
        a turn, with the registration gone and the leases not released yet still held (they
        expire); callers at a session's end run it shielded.
        """
        core = self.core
        self.prefetch.cancel_owner(session_id)
        registration = core.registry.unregister(session_id)
        # A copy path that copies on the server may still be writing the reservations.
        quarantine = quarantine or (registration is not None and registration.copy.copies_on_server)
        released = 0
        while True:
            count = core.release_slice(session_id, quarantine=quarantine)
            released += count
            if count < RELEASE_SLICE:
                break
            await self.turn()
        if registration is not None:
            registration.copy.close()  # (once the copies queued so far are done)
            log.info(
                "session %s unregistered %s rank %d",
                session_id,
                registration.model,
                registration.rank,
                extra=event(
                    "unregistration",
                    session=session_id,
                    model=registration.model,
                    rank=registration.rank,
                    released=released,
                ),
            )
        return released
