"""Lookup, and the ends of a request's lookup (``free_lookup_locks``, ``end_session``).

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
from ...storage import LeaseKind
from .._session import Session
from .._state import Later
from ..l2tier import TierBackend
from ._batch import SLICE_KEYS
from ._core import CacheCore
from ._keys import RequestKey, checked_hashes, request_key
from ._limits import check_lookup_keys
from ._registry import ModelEntry

__all__ = ["Lookups"]


class Lookups:
    """The lookup operations and their counters."""

    def __init__(self, core: CacheCore) -> None:
        self.core = core
        self.lookups = 0
        self.hit_chunks = 0
        self.miss_chunks = 0
        self.l2_chunks = 0
        self.timeouts = 0
        """Lookups whose L2 part ran out of ``lookup_timeout``."""

    def lookup(self, session: Session, lookup: Lookup) -> LookupReply | Later:
        """Pin the L1 prefix now; L2 work, if any, is left to a :class:`Later`."""
        core = self.core
        core.settle_copies()  # copies the worker already saw done are visible
        hashes = checked_hashes(lookup.chunk_hashes)
        keys = check_lookup_keys(lookup.world_size, len(hashes))  # bounded before any work
        model = core.registry.engine_model(lookup.engine, lookup.model, lookup.tenant)
        if model is None:
            return LookupReply(0, 0, 0)  # no worker of this engine has registered (yet)
        if lookup.world_size != model.world_size:
            raise RequestError(
                ErrorCode.INCOMPATIBLE,
                f"model {lookup.model!r} is registered with world size {model.world_size}, "
                f"the lookup says {lookup.world_size}",
            )
        now = trio.current_time()
        request = request_key(lookup.engine, lookup.model, lookup.tenant, lookup.request)
        core.admit(session, request, lookup.tenant)
        # A new lookup of the request replaces the previous one: its pins and its loads.
        core.end_lookup(request)
        core.quotas.readers(lookup.num_readers, model.world_size)
        readers = lookup.num_readers or (
            model.world_size if model.profile.shared_across_ranks else 1
        )
        expires = now + core.config.pin_ttl
        # The first slice of chunks is looked up and pinned now, atomically, as every lookup
        # was; the rest of a long prefix (beyond SLICE_KEYS keys) in the Later, slice by slice.
        first = max(1, SLICE_KEYS // len(model.spaces))
        if core.l2.enabled or len(hashes) > first:  # (it may go on in a Later)
            core.budget.check(session.id, session.principal.user_id, keys)
        pending = core.budget.total  # (the L2 parts under way may pin that many)
        core.limits.admit_pins(core.leases, len(hashes) * len(model.spaces), pending, lookup.tenant)
        hit = self._pin_prefix(session, request, model, hashes[:first], readers, expires, True)
        more = hit == first < len(hashes)
        l2_part = core.l2.enabled and (more or hit < len(hashes))
        core.watch(session)
        if not (l2_part or more):
            return self._done(len(hashes), hit, 0)
        # Counted in flight until the Later ends. (A concurrent operation's Later always
        # starts: trio runs a spawned task's first step, which enters the try below.)
        user = session.principal.user_id
        core.budget.take(session.id, user, keys)
        taken = [keys]

        def give() -> None:  # once, whichever comes first
            if taken:
                core.budget.give(session.id, user, taken.pop())

        async def rest() -> LookupReply:
            try:
                found = hit
                if more:
                    found = await self._pin_rest(session, request, model, hashes, hit, readers,
                                                 expires)  # fmt: skip
                if not core.l2.enabled or found == len(hashes):
                    return self._done(len(hashes), found, 0)
                return await self._lookup_l2(session, request, model, hashes, found, readers)
            finally:
                give()

        return Later(rest, give)

    def _pin_prefix(
        self,
        session: Session,
        request: RequestKey,
        model: ModelEntry,
        hashes: Sequence[bytes],
        readers: int,
        expires: float,
        first: bool,
    ) -> int:
        """Find how many leading ``hashes`` every namespace has in L1 and pin them for
        ``request``; the count. The quotas are admitted before any pin: a refusal raises
        (``first``) or, for a later slice, ends the prefix there (0)."""
        core = self.core
        hit = len(hashes)
        for space in model.spaces:
            hit = core.l1.prefix([space + h for h in hashes[:hit]])
        if hit:
            pinned = [space + h for space in model.spaces for h in hashes[:hit]]
            try:
                core.quotas.admit(session, len(pinned), model.chunk_bytes)
                core.quotas.admit_pins(pinned, model.chunk_bytes)
            except RequestError:
                if first:
                    raise
                return 0
        for chunk_hash in hashes[:hit]:  # pinned before awaiting anything: they stay
            for space in model.spaces:
                core.pin_for_lookup(request, session.id, space + chunk_hash, readers, expires)
        if hit and core.l2.enabled:  # L1 hits are uses in L2's policies too (the head last)
            core.l2.touches.add(space + h for h in reversed(hashes[:hit]) for space in model.spaces)
            core.l2.writes.rewrite(space + h for h in hashes[:hit] for space in model.spaces)
        return hit

    async def _pin_rest(
        self,
        session: Session,
        request: RequestKey,
        model: ModelEntry,
        hashes: Sequence[bytes],
        hit: int,
        readers: int,
        expires: float,
    ) -> int:
        """Pin the L1 prefix after the first ``hit`` chunks, one slice of :data:`SLICE_KEYS`
        keys at a time, yielding to the event loop before each; the whole prefix's length.

        Between slices other requests run: a slice sees L1 as it is then (what the earlier
        slices pinned stays). If the request's lookup pins went away meanwhile (the request
        ended, or a new lookup of it replaced this one), it stops there. Cancellation (the
        session ends): at a yield; the pins end with the request or the session.
        """
        core = self.core
        size = max(1, SLICE_KEYS // len(model.spaces))
        marker = model.spaces[0] + hashes[0]
        while hit < len(hashes):
            await core.turn()
            if core.leases.get(LeaseKind.LOOKUP, request, session.id, marker) is None:
                break  # (ended or replaced: what it pinned was released with it)
            part = hashes[hit : hit + size]
            found = self._pin_prefix(session, request, model, part, readers, expires, False)
            hit += found
            if found < len(part):
                break
        return hit

    async def _lookup_l2(
        self,
        session: Session,
        request: RequestKey,
        model: ModelEntry,
        hashes: Sequence[bytes],
        hit: int,
        readers: int,
    ) -> LookupReply:
        """The L2 part of a lookup: find the missing chunks there and start their loads.

        Cancellation (the session ends): the L2 lookup unlocks what it locked; loads already
        started belong to the request and end with it.
        """
        core = self.core
        admission = core.l2.writes.admission
        if admission.first_lookup(request):  # (seen by one more request: L2 admission)
            keys = [space + h for h in hashes[hit:] for space in model.spaces]
            for first in range(0, len(keys), SLICE_KEYS):
                if first:
                    await core.turn()
                admission.count(keys[first : first + SLICE_KEYS])
        sources: list[list[TierBackend]] = []
        with trio.move_on_after(core.config.lookup_timeout) as scope:
            sources = await core.l2.loads.lookup(model.spaces, hashes[hit:])
        if scope.cancelled_caught:
            self.timeouts += 1  # (l2.loads.lookup unlocked what it had locked)
        found = hashes[hit : hit + len(sources)]
        if core.registry.models.get(model.key) is None:
            # Every worker of the model left while the backends answered: nothing to load for.
            await core.l2.loads.release(sources, [[s + h for s in model.spaces] for h in found])
            raise RequestError(ErrorCode.INCOMPATIBLE, "no worker of this model is registered")
        loaded = await core.prefetch.start(
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
        chunk_size = self.core.config.chunk_size
        return LookupReply(hit_tokens=total * chunk_size, hit_chunks=total, l1_chunks=hit)

    # ----------------------------------------------------------------- request ends

    def free_lookup_locks(self, session: Session, free: FreeLookupLocks) -> Released:
        """Release the request's lookup pins and cancel its loads (the engine will not
        retrieve, or has retrieved)."""
        request = request_key(free.engine, free.model, free.tenant, free.request)
        return Released(self.core.end_lookup(request))

    def end_session(self, session: Session, end: EndSession) -> Released:
        """The request is over: release its lookup pins and cancel its loads. (The operation's
        name is the wire's: it ends a *request*, not this connection's session.)"""
        # A worker's store or retrieve may still be under way (engines save asynchronously):
        # its reservations and read pins are its own leases, ended by its commit/release.
        request = request_key(end.engine, end.model, end.tenant, end.request)
        return Released(self.core.end_lookup(request))
