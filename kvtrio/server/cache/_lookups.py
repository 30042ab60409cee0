"""Lookup, and the ends of an engine request's lookup (``free_lookup_locks``, ``end_session``).

A lookup pins the L1 prefix of the request's chunks at once, inline, for every namespace of
the model (each rank's, or the one all ranks share). If L2 is on and the prefix stops short,
the rest is a :class:`Later`: the L2 lookup (bounded by ``lookup_timeout``) and the start of the
loads (``_prefetch``), whose chunks are then pinned like L1 hits as they arrive. L1 is pinned
first, so nothing found there can be evicted while the lookup waits for the backends.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ...errors import ErrorCode, RequestError
from ...protocol import EndSession, FreeLookupLocks, Lookup, LookupReply, Released
from .._session import Session
from .._state import Later
from ..l2tier import TierBackend
from ._core import SLICE_KEYS, LookupStep
from ._io import CacheIO
from ._keys import RequestKey, request_key
from ._registry import ModelEntry

__all__ = ["Lookups"]


class Lookups:
    """The lookup operations and their counters."""

    def __init__(self, io: CacheIO) -> None:
        self.io = io
        self.lookups = 0
        self.hit_chunks = 0
        self.miss_chunks = 0
        self.l2_chunks = 0
        self.timeouts = 0
        """Lookups whose L2 part ran out of ``lookup_timeout``."""

    def lookup(self, session: Session, lookup: Lookup) -> LookupReply | Later:
        """Pin the L1 prefix now (the core's step); L2 work, if any, is left to a Later."""
        io, core = self.io, self.io.core
        io.settle_copies()  # copies the worker already saw done are visible
        start = core.lookup(session, lookup)
        if start is None:
            return LookupReply(0, 0, 0)  # no worker of this engine has registered (yet)
        io.watch(session)  # (its end releases what it pins)
        io.prefetch.cancel_request(start.request)  # (the lookup it replaces: its loads)
        step = core.pin_first(session, lookup, start, l2=io.l2.enabled)
        request, model, hashes = step.request, step.model, step.hashes
        io.touched(model.spaces, hashes[: step.hit])
        if step.done:
            return self._done(len(hashes), step.hit, 0)
        # Counted in flight until the Later ends. (A concurrent operation's Later always
        # starts: trio runs a spawned task's first step, which enters the try below.)
        user = session.user
        core.budget.take(session.id, user, step.keys)
        taken = [step.keys]
        number = core.looking(request)

        def give() -> None:  # once, whichever comes first
            core.done_looking(request, number)
            if taken:
                core.budget.give(session.id, user, taken.pop())

        async def rest() -> LookupReply:
            try:
                found = step.hit
                if step.more:
                    found = await self._pin_rest(session, step, number)
                if not io.l2.enabled or found == len(hashes):
                    return self._done(len(hashes), found, 0)
                return await self._lookup_l2(session, request, number, model, hashes, found,
                                             step.readers)  # fmt: skip
            finally:
                give()

        return Later(rest, give)

    async def _pin_rest(self, session: Session, step: LookupStep, number: int) -> int:
        """Pin the L1 prefix after the first ``step.hit`` chunks, one slice of
        :data:`SLICE_KEYS` keys at a time, yielding to the event loop before each; the whole
        prefix's length.

        Between slices other requests run: a slice sees L1 as it is then (what the earlier
        slices pinned stays). If lookup ``number`` is no longer the request's meanwhile (the
        request ended, or a new lookup of it replaced this one), it stops there. Cancellation (the
        session ends): at a yield; the pins end with the request or the session.
        """
        io, core = self.io, self.io.core
        model, hashes, hit = step.model, step.hashes, step.hit
        size = max(1, SLICE_KEYS // len(model.spaces))
        while hit < len(hashes):
            await io.turn()
            if not core.still_current(step.request, number):
                break  # (ended or replaced: what it pinned was released with it)
            part = hashes[hit : hit + size]
            found = core.pin_prefix(session, step.request, model, part, step.readers,
                                    step.expires, False)  # fmt: skip
            io.touched(model.spaces, part[:found])
            hit += found
            if found < len(part):
                break
        return hit

    async def _lookup_l2(
        self,
        session: Session,
        request: RequestKey,
        number: int,
        model: ModelEntry,
        hashes: Sequence[bytes],
        hit: int,
        readers: int,
    ) -> LookupReply:
        """The L2 part of lookup ``number`` of ``request``: find the missing chunks there and
        start their loads, unless the request ended or a new lookup replaced this one while
        the backends answered (then it unlocks them, loads nothing and pins nothing: no end
        would come for those pins but ``pin_ttl``).

        Cancellation (the session ends): the L2 lookup unlocks what it locked; loads already
        started belong to the request and end with it.
        """
        io = self.io
        admission = io.l2.writes.admission
        if admission.first_lookup(request):  # (seen by one more request: L2 admission)
            keys = [space + h for h in hashes[hit:] for space in model.spaces]
            for first in range(0, len(keys), SLICE_KEYS):
                if first:
                    await io.turn()
                admission.count(keys[first : first + SLICE_KEYS])
        sources: list[list[TierBackend]] = []
        with trio.move_on_after(io.config.lookup_timeout) as scope:
            sources = await io.l2.loads.lookup(model.spaces, hashes[hit:])
        if scope.cancelled_caught:
            self.timeouts += 1  # (l2.loads.lookup unlocked what it had locked)
        found = hashes[hit : hit + len(sources)]
        current = io.core.still_current(request, number)
        if not current or io.core.registry.models.get(model.key) is None:
            # Ended or replaced, or every worker of the model left, while the backends
            # answered: nothing to load for.
            await io.l2.loads.release(sources, [[s + h for s in model.spaces] for h in found])
            if current:
                raise RequestError(ErrorCode.INCOMPATIBLE, "no worker of this model is registered")
            return self._done(len(hashes), hit, 0)
        loaded = await io.prefetch.start(
            session.id,
            request,
            model.spaces,
            found,
            sources,
            readers,
            model.fingerprint,
            model.chunk_bytes,
        )
        return self._done(len(hashes), hit, loaded)

    def _done(self, chunks: int, hit: int, loaded: int) -> LookupReply:
        self.lookups += 1
        self.hit_chunks += hit + loaded
        self.l2_chunks += loaded
        self.miss_chunks += chunks - hit - loaded
        total = hit + loaded
        chunk_size = self.io.config.chunk_size
        return LookupReply(hit_tokens=total * chunk_size, hit_chunks=total, l1_chunks=hit)

    # ----------------------------------------------------------------- request ends

    def free_lookup_locks(self, session: Session, free: FreeLookupLocks) -> Released:
        """Release the request's lookup pins and cancel its loads (the engine will not
        retrieve, or has retrieved)."""
        request = request_key(free.engine, free.model, free.tenant, free.request)
        return Released(self.io.end_lookup(request))

    def end_request(self, session: Session, end: EndSession) -> Released:
        """The engine request is over (the wire's ``end_session``, a name kept from before:
        it ends an engine request, not a session): release its lookup pins and cancel its
        loads."""
        # A worker's store or retrieve may still be under way (engines save asynchronously):
        # its reservations and read pins are its own leases, ended by its commit/release.
        request = request_key(end.engine, end.model, end.tenant, end.request)
        return Released(self.io.end_lookup(request))
