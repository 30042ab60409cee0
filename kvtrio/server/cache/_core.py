"""The cache core: the state every cache operation shares, and the steps they share.

All state changes happen synchronously inside a handler (no checkpoint in the middle), so each
operation is atomic with respect to every other. Every pin and reservation is a lease
(``storage.LeaseTable``) undone exactly once: by the operation that ends it (commit, release,
a server-side copy's completion), by the request's end, by its session's end, or by the reaper
when it expires. This module holds the tables and those ends; the operations are in
``_lookups``, ``_writes``, ``_reads`` and ``_registrations``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import trio

from ..._logging import event
from ...config import ServerConfig
from ...errors import ErrorCode, RequestError
from ...protocol import Retrieve, Store
from ...storage import L1Cache, Lease, LeaseKind, LeaseTable
from .._session import Session
from .._tenants import TenantArena, TenantArenas
from ..l2tier import L2Tier
from ._copy import WriteEnd
from ._keys import RequestKey, checked_hashes, request_key
from ._limits import KeyBudget, RequestLimits, key_group, tenant_group
from ._prefetch import Prefetcher
from ._quotas import Quotas
from ._registry import Registration, Registry

__all__ = ["CacheCore", "ChunkNaming"]

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


RELEASE_SLICE = 4096
"""Leases a session's end releases between two turns (popping and undoing one takes a few µs)."""


class CacheCore:
    """The L1 cache's tables (one per server) and the steps the operations share."""

    def __init__(
        self,
        config: ServerConfig,
        arenas: TenantArenas,
        l2: L2Tier,
        settle_copies: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.settle_copies = settle_copies
        """Run the completions of server-side copies that have already finished (non-blocking):
        called first by the operations that read the cache, so a copy the worker saw done is
        visible to its next request."""
        self.arenas = arenas  # one per tenant (docs/security.md)
        self.l1: L1Cache = arenas.l1
        self.l2 = l2
        self.users: dict[str, str] = {}
        """The client key of each watched session (its requests count against the key)."""
        self.leases = LeaseTable(self._groups_of)
        self.quotas = Quotas(config, self.leases, self.l1)
        self.registry = Registry(config.chunk_size)
        self.limits = RequestLimits(
            config.max_requests, config.max_pins, config.l1_tenants, config.lease_share_per_key
        )
        self.budget = KeyBudget()
        """Keys of lookups still in their L2 part, per session and client key (issue 22)."""
        self.slices = trio.CapacityLimiter(1)
        """The turn to run one slice of a big message's work (see :meth:`turn`)."""
        self.prefetch = Prefetcher(self.l1, l2, config, self.pin_for_lookup)
        self._watched: set[str] = set()  # sessions whose end releases their leases
        self.announcer: ChunkNaming | None = None
        """The KV events' announcer (``--events``), if any."""

    # ----------------------------------------------------------------- who and what

    def registration(self, session: Session) -> Registration:
        """The session's registration, or ``not_registered``."""
        registration = self.registry.by_session.get(session.id)
        if registration is None:
            raise RequestError(
                ErrorCode.NOT_REGISTERED,
                "this client has not registered a KV cache (or its session ended): register first",
            )
        return registration

    def worker_request(self, registration: Registration, request_id: str) -> RequestKey:
        """A worker's requests are its engine's: scoped by engine, model and tenant."""
        return request_key(registration.engine, registration.model, registration.tenant, request_id)

    def chunks(
        self, registration: Registration, op: Store | Retrieve
    ) -> tuple[RequestKey, Sequence[bytes], range]:
        """The request key, the chunk hashes and the chunk indices of ``[start, end)``, checked;
        the request is admitted (``busy`` beyond ``max_requests``)."""
        size = self.config.chunk_size
        if op.start % size or op.start < 0 or op.end < op.start:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"the range [{op.start}, {op.end}) must start at a multiple of the "
                f"chunk size {size} and not end before it starts",
            )
        chunks = range(op.start // size, op.end // size)
        hashes = checked_hashes(op.chunk_hashes)
        if len(hashes) != len(chunks):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"the range [{op.start}, {op.end}) has {len(chunks)} full chunks; "
                f"send exactly their {len(chunks)} chunk hashes (got {len(hashes)})",
            )
        request = self.worker_request(registration, op.request)
        user = self.users.get(registration.session_id, "")
        self.limits.admit_request(self.leases, request, registration.tenant, user)
        return request, hashes, chunks

    def admit(self, session: Session, request: RequestKey, tenant: str) -> None:
        """Admit ``request`` of ``tenant`` for ``session`` (``busy`` beyond the server's, the
        tenant's or the client key's share of ``max_requests``); the session's end will
        release what it takes (:meth:`watch`)."""
        self.watch(session)
        self.limits.admit_request(self.leases, request, tenant, session.principal.user_id)

    def _groups_of(self, lease: Lease) -> tuple[str, ...]:
        """The groups a request counts in, from its first lease: the tenant whose arena holds
        the chunk, and the client key of the session that took it (if any)."""
        arena = self.arenas.of_key(lease.key)
        tenant = "" if arena is None or arena.tenant is None else arena.tenant
        user = self.users.get(lease.owner, "")
        if not user:
            return (tenant_group(tenant),)
        return tenant_group(tenant), key_group(tenant, user)

    def arena_idle(self, tenant_arena: TenantArena) -> bool:
        """Whether the arena's tenant has nothing registered and nothing pinned or being
        written in it (nothing refers to its bytes): it may be renewed for another tenant."""
        tenant = tenant_arena.tenant
        stats = tenant_arena.l1.stats()
        if stats.pinned_entries or stats.writing:
            return False
        return all(r.tenant != tenant for r in self.registry.by_session.values())

    async def turn(self) -> None:
        """Yield to the event loop, then wait for this task's turn to run the next slice of
        a big message's work. Turns go one task at a time, first come first served, so that
        many big messages at once still run about one slice per scheduling round, not one
        each (trio runs every runnable task before it polls the sockets again). Cancellation:
        raises Cancelled (the caller's slices so far stay done)."""
        async with self.slices:
            pass

    def local(self, offset: int) -> int:
        """An L1 entry's offset in its tenant's arena file (what the worker maps)."""
        return self.arenas.of_offset(offset).local(offset)

    # ----------------------------------------------------------------- lease ends

    def pin_for_lookup(
        self, request: RequestKey, owner: str, object_key: bytes, readers: int, expires: float
    ) -> None:
        self.l1.pin(object_key, readers)
        self.leases.add(LeaseKind.LOOKUP, request, owner, object_key, readers, expires)

    def end_lookup(self, request: RequestKey) -> int:
        """Release a request's lookup pins and cancel its pending loads."""
        self.prefetch.cancel_request(request)
        return self.undo(self.leases.pop_request(request, [LeaseKind.LOOKUP]), quarantine=False)

    def end_write(
        self,
        owner: str,
        request: RequestKey,
        object_key: bytes,
        how: WriteEnd,
        fingerprint: bytes,
        written: list[trio.Event] | None = None,
    ) -> bool:
        """End ``owner``'s write reservation of ``object_key`` for ``request``: ``commit`` it
        (visible, and queued for L2 with ``fingerprint``), ``abort`` it, or ``quarantine`` its
        slot. False if there is none (never reserved, expired, or its session ended). With
        write-through, the event set once a committed chunk's L2 writes ended is appended to
        ``written``."""
        lease = self.leases.get(LeaseKind.WRITE, request, owner, object_key)
        if lease is None:
            return False
        self.leases.remove(lease)
        if how == "commit":
            self.l1.commit(object_key)
            arena = self.arenas.of_key(object_key)
            tenant = "" if arena is None or arena.tenant is None else arena.tenant
            event = self.l2.writes.commit(object_key, fingerprint, tenant)
            if event is not None and written is not None:
                written.append(event)
        elif how == "abort":
            self.l1.abort(object_key)
        else:
            self.l1.abort_quarantined(object_key, trio.current_time() + self.config.reservation_ttl)
        return True

    def end_reads(self, owner: str, request: RequestKey, object_keys: Sequence[bytes]) -> int:
        """Unpin ``owner``'s read pins of ``object_keys`` for ``request`` that still exist."""
        leases = []
        for object_key in object_keys:
            lease = self.leases.get(LeaseKind.READ, request, owner, object_key)
            if lease is not None:
                self.leases.remove(lease)
                leases.append(lease)
        return self.undo(leases, quarantine=False)

    def undo(self, leases: Sequence[Lease], *, quarantine: bool) -> int:
        """Undo what removed leases held: unpin, or drop a reservation. Returns the count."""
        l1 = self.l1
        for lease in leases:
            if lease.kind is LeaseKind.WRITE:
                if quarantine:
                    l1.abort_quarantined(
                        lease.key, trio.current_time() + self.config.reservation_ttl
                    )
                else:
                    l1.abort(lease.key)
            else:
                l1.unpin(lease.key, lease.count)
        return len(leases)

    # ----------------------------------------------------------------- sessions

    def watch(self, session: Session) -> None:
        """Make the session's end release everything it holds (once per session)."""
        if session.id in self._watched:
            return
        self._watched.add(session.id)
        if session.principal.user_id:
            self.users[session.id] = session.principal.user_id

        async def session_ended() -> None:
            self._watched.discard(session.id)
            self.users.pop(session.id, None)
            # The client may still be alive (silent, not dead): a late write must land in a
            # quarantined slot, never in one handed to someone else.
            await self.release_session(session.id, quarantine=True)

        session.add_cleanup(session_ended)

    async def release_session(self, session_id: str, *, quarantine: bool) -> int:
        """Drop the session's registration (if any) and every lease it holds; cancel the loads
        it started. Returns how many leases were released.

        The leases go :data:`RELEASE_SLICE` at a time, taking turns (:meth:`turn`) in between
        (a session holding 100k pins took ~0.4 s of the loop to end). Cancellation: at a
        turn, with the registration gone and the leases not released yet still held (they
        expire); callers at a session's end run it shielded.
        """
        self.prefetch.cancel_owner(session_id)
        registration = self.registry.unregister(session_id)
        # A copy path that copies on the server may still be writing the reservations.
        quarantine = quarantine or (registration is not None and registration.copy.copies_on_server)
        released = 0
        while True:
            leases = self.leases.pop_owner(session_id, RELEASE_SLICE)
            released += self.undo(leases, quarantine=quarantine)
            if len(leases) < RELEASE_SLICE:
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
