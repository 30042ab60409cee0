"""The cache core: the L1 tables of one server and every step on them, with no I/O.

:class:`CacheCore` owns the tenants' L1 (through ``TenantArenas``), the leases, the registry,
the quotas and the limits. It takes a caller (a session id and its client key) and a request,
changes its tables synchronously and says what is next as data: an L1 answer and whether the
lookup needs the rest of its chunks from L2 by a deadline (:class:`LookupStep`), a store's
slots and the chunks present already (to be rewritten to L2), a commit's chunks for the
write-behind (:class:`L2Write`). It imports neither trio nor ZeroMQ and knows no session, no
turn, no L2 tier: the handlers above it (``_lookups``, ``_writes``, ``_reads``,
``_registrations``, over ``_io.CacheIO``) do, as h11's ``Connection`` is driven by whoever owns
the socket. Its clock is passed in (the server's: trio's).

Every pin and reservation is a lease (``storage.LeaseTable``) undone exactly once: by the
operation that ends it (commit, release, a server-side copy's completion), by the request's
end, by its session's end (:meth:`CacheCore.release_slice`), or by the reaper when it expires
(:meth:`CacheCore.expire`). Each step is atomic: it never yields.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ...config import ServerConfig
from ...errors import ErrorCode, RequestError
from ...protocol import Lookup, Retrieve, Slot, Store
from ...storage import Entry, L1Cache, Lease, LeaseKind, LeaseTable, Reservation
from ._keys import RequestKey, WriteEnd, checked_hashes, request_key
from ._limits import KeyBudget, RequestLimits, check_lookup_keys, key_group, tenant_group
from ._quotas import Quotas
from ._registry import ModelEntry, Registration, Registry
from ._steps import Caller, Client, L2Write, LookupStart, LookupStep

if TYPE_CHECKING:
    from .._tenants import TenantArena, TenantArenas

__all__ = [
    "RELEASE_SLICE",
    "SLICE_KEYS",
    "CacheCore",
    "Caller",
    "Client",
    "L2Write",
    "LookupStart",
    "LookupStep",
]

log = logging.getLogger("kvtrio.cache")

RELEASE_SLICE = 4096
"""Leases a session's end releases between two turns (popping and undoing one takes a few µs)."""
SLICE_KEYS = 1024
"""Keys of lookups handled between two yields to the event loop: a batch's lookups, and the
L1 prefix of one long lookup (pinning 1,024 keys takes ~10 ms here on an idle machine, up to
~50 ms with the 2 cores loaded 4×; the largest message yields 64 times)."""


class CacheCore:
    """The L1 cache's tables (one per server) and the steps on them. No I/O."""

    def __init__(
        self, config: ServerConfig, arenas: TenantArenas, clock: Callable[[], float]
    ) -> None:
        """``arenas``: the tenants' L1 arenas (their files are created above; the core only
        reads and changes their indexes); ``clock``: the time leases expire in (trio's)."""
        self.config = config
        self.clock = clock
        self.arenas = arenas  # one per tenant (docs/security.md)
        self.l1: L1Cache = arenas.l1
        self.users: dict[str, str] = {}
        """The client key of each session the core knows (its requests count against it)."""
        self._by_user: dict[str, set[str]] = {}
        self.leases = LeaseTable(self._groups_of)
        self._held_reads: list[tuple[float, int, bytes, int]] = []
        """Read pins kept past their lease's end: ``(until, seq, key, count)``, a heap (see
        :meth:`undo`)."""
        self._held_seq = itertools.count()
        self._looking: dict[RequestKey, int] = {}
        """The number of each request's lookup that is still going on past its first step
        (:meth:`looking`); a lookup's end or replacement drops it."""
        self._lookup_numbers = itertools.count()
        self.quotas = Quotas(config, self.leases, self.l1)
        self.registry = Registry(config.chunk_size)
        self.limits = RequestLimits(
            config.max_requests, config.max_pins, config.l1_tenants, config.lease_share_per_key
        )
        self.budget = KeyBudget()
        """Keys of lookups still in their L2 part, per session and client key (issue 22)."""

    # ----------------------------------------------------------------- who and what

    def enter(self, caller: Caller) -> None:
        """Know ``caller`` (its leases count against its client key; whoever runs its session
        calls :meth:`leave` and :meth:`release_slice` at its end). Idempotent."""
        if caller.id in self.users:
            return
        self.users[caller.id] = caller.user
        if caller.user:
            self._by_user.setdefault(caller.user, set()).add(caller.id)

    def leave(self, owner: str) -> None:
        """Forget the session ``owner`` (its end); its leases are released separately."""
        user = self.users.pop(owner, "")
        owners = self._by_user.get(user)
        if owners is not None:
            owners.discard(owner)
            if not owners:
                del self._by_user[user]

    def registration(self, owner: str) -> Registration:
        """The session's registration, or ``not_registered``."""
        registration = self.registry.by_session.get(owner)
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

    def admit(self, caller: Caller, request: RequestKey, tenant: str) -> None:
        """Admit ``request`` of ``tenant`` for ``caller`` (``busy`` beyond the server's, the
        tenant's or the client key's share of ``max_requests``)."""
        self.limits.admit_request(self.leases, request, tenant, caller.user)

    def admit_leases(self, caller: Caller, new: int, chunk_bytes: int) -> None:
        """``quota_exceeded`` if ``new`` more leases of ``chunk_bytes`` each would exceed the
        caller's session limit or its client key's share of L1."""
        owners = self._by_user.get(caller.user, ()) if caller.user else ()
        self.quotas.admit(caller.id, caller.user, new, chunk_bytes, owners)

    def admit_store(self, caller: Caller, registration: Registration, chunks: int) -> None:
        """Refuse (``quota_exceeded``, ``busy``) a store of ``chunks`` chunks that would exceed
        the caller's leases or its tenant's pins; nothing is reserved yet."""
        self.admit_leases(caller, chunks, registration.chunk_bytes)
        self.limits.admit_pins(self.leases, chunks, tenant=registration.tenant)

    def admit_reads(self, caller: Caller, keys: Sequence[bytes], chunk_bytes: int) -> None:
        """Refuse (``quota_exceeded``) reads of ``keys`` that would exceed the caller's leases
        or the pins a key's share allows; nothing is pinned yet."""
        self.admit_leases(caller, len(keys), chunk_bytes)
        self.quotas.admit_pins(keys, chunk_bytes)

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

    def local(self, offset: int) -> int:
        """An L1 entry's offset in its tenant's arena file (what the worker maps)."""
        return self.arenas.of_offset(offset).local(offset)

    # ----------------------------------------------------------------- lookups

    def lookup(self, caller: Caller, lookup: Lookup) -> LookupStart | None:
        """Check ``lookup``, admit its request and release the pins of the request's previous
        lookup, which this one replaces (its loads are to be cancelled: see
        :attr:`LookupStart.request`); None if no worker of its engine has registered. Raises
        :class:`RequestError` (nothing changed) on a bad field or a refused limit."""
        hashes = checked_hashes(lookup.chunk_hashes)
        keys = check_lookup_keys(lookup.world_size, len(hashes))  # bounded before any work
        model = self.registry.engine_model(lookup.engine, lookup.model, lookup.tenant)
        if model is None:
            return None
        if lookup.world_size != model.world_size:
            raise RequestError(
                ErrorCode.INCOMPATIBLE,
                f"model {lookup.model!r} is registered with world size {model.world_size}, "
                f"the lookup says {lookup.world_size}",
            )
        request = request_key(lookup.engine, lookup.model, lookup.tenant, lookup.request)
        self.admit(caller, request, lookup.tenant)
        self.enter(caller)  # (admitted first: a refused caller's session is never watched)
        self.end_lookup(request)
        return LookupStart(request, model, hashes, keys)

    def pin_first(
        self, caller: Caller, lookup: Lookup, start: LookupStart, *, l2: bool
    ) -> LookupStep:
        """Admit the started lookup's pins and pin the L1 prefix of its first slice
        (:data:`SLICE_KEYS` keys); what is left as data. ``l2``: whether the server has an L2
        to ask for the rest. Raises :class:`RequestError` (nothing pinned) on a refused
        limit."""
        model, hashes = start.model, start.hashes
        now = self.clock()
        self.quotas.readers(lookup.num_readers, model.world_size)
        readers = lookup.num_readers or (
            model.world_size if model.profile.shared_across_ranks else 1
        )
        expires = now + self.config.pin_ttl
        # The first slice of chunks is looked up and pinned now, atomically; the rest of a
        # long prefix (beyond SLICE_KEYS keys) slice by slice (:meth:`pin_prefix`).
        first = max(1, SLICE_KEYS // len(model.spaces))
        if l2 or len(hashes) > first:  # (it may go on)
            self.budget.check(caller.id, caller.user, start.keys)
        pending = self.budget.total  # (the L2 parts under way may pin that many)
        self.limits.admit_pins(self.leases, len(hashes) * len(model.spaces), pending, lookup.tenant)
        hit = self.pin_prefix(caller, start.request, model, hashes[:first], readers, expires, True)
        more = hit == first < len(hashes)
        return LookupStep(
            request=start.request,
            model=model,
            hashes=hashes,
            hit=hit,
            readers=readers,
            expires=expires,
            keys=start.keys,
            more=more,
            l2=l2 and (more or hit < len(hashes)),
            deadline=now + self.config.lookup_timeout,
        )

    def pin_prefix(
        self,
        caller: Caller,
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
        hit = len(hashes)
        for space in model.spaces:
            hit = self.l1.prefix([space + h for h in hashes[:hit]])
        if hit:
            pinned = [space + h for space in model.spaces for h in hashes[:hit]]
            try:
                self.admit_leases(caller, len(pinned), model.chunk_bytes)
                self.quotas.admit_pins(pinned, model.chunk_bytes)
            except RequestError:
                if first:
                    raise
                return 0
        for chunk_hash in hashes[:hit]:
            for space in model.spaces:
                self.pin_for_lookup(request, caller.id, space + chunk_hash, readers, expires)
        return hit

    def pin_for_lookup(
        self, request: RequestKey, owner: str, object_key: bytes, readers: int, expires: float
    ) -> None:
        """Pin an L1 entry for ``readers`` reads of ``request`` (a lease of ``owner``)."""
        self.l1.pin(object_key, readers)
        self.leases.add(LeaseKind.LOOKUP, request, owner, object_key, readers, expires)

    def looking(self, request: RequestKey) -> int:
        """Number ``request``'s lookup that goes on past its first step (its L1 slices, its
        L2 part): the number stays current (:meth:`still_current`) until the request ends or
        a new lookup replaces this one, or :meth:`done_looking`."""
        number = self._looking[request] = next(self._lookup_numbers)
        return number

    def still_current(self, request: RequestKey, number: int) -> bool:
        """Whether lookup ``number`` is still ``request``'s: neither ended nor replaced (what
        its first pin could not tell where it pinned nothing: an L1 miss going to L2)."""
        return self._looking.get(request) == number

    def done_looking(self, request: RequestKey, number: int) -> None:
        """Lookup ``number`` of ``request`` is over (idempotent)."""
        if self._looking.get(request) == number:
            del self._looking[request]

    def end_lookup(self, request: RequestKey) -> int:
        """Release a request's lookup pins, and make its lookup that goes on no longer current;
        how many pins (its loads are cancelled above)."""
        self._looking.pop(request, None)
        return self.undo(self.leases.pop_request(request, [LeaseKind.LOOKUP]), quarantine=False)

    # ----------------------------------------------------------------- writes

    def reserve(
        self,
        owner: str,
        registration: Registration,
        request: RequestKey,
        chunks: range,
        hashes: Sequence[bytes],
        parent: bytes | None,
        expires: float,
        slots: list[Slot],
        reserved: list[Entry],
        present: list[bytes],
    ) -> bytes | None:
        """Reserve the slots of ``chunks`` (prompt indices; ``hashes`` theirs), appending to
        ``slots`` and ``reserved``, and to ``present`` the keys already in L1 (to be written to
        L2 if they never reached it); returns the last chunk's object key (the next parent)."""
        l1 = self.l1
        for index, chunk_hash in zip(chunks, hashes, strict=True):
            object_key = registration.space + chunk_hash
            outcome = l1.reserve(object_key, registration.chunk_bytes, parent=parent)
            parent = object_key
            if isinstance(outcome, Entry):
                self.leases.add(LeaseKind.WRITE, request, owner, object_key, 1, expires)
                slots.append(Slot(index, "write", self.local(outcome.offset), outcome.nbytes))
                reserved.append(outcome)
            elif outcome is Reservation.PRESENT:
                slots.append(Slot(index, "present"))
                present.append(object_key)
            elif outcome is Reservation.IN_PROGRESS:
                slots.append(Slot(index, "busy"))
            else:
                slots.append(Slot(index, "failed"))
        return parent

    def end_write(
        self,
        owner: str,
        request: RequestKey,
        object_key: bytes,
        how: WriteEnd,
        fingerprint: bytes,
        writes: list[L2Write] | None = None,
    ) -> bool:
        """End ``owner``'s write reservation of ``object_key`` for ``request``: ``commit`` it
        (visible; appended to ``writes`` for the L2 write-behind with ``fingerprint``),
        ``abort`` it, or ``quarantine`` its slot. False if there is none (never reserved,
        expired, or its session ended)."""
        lease = self.leases.get(LeaseKind.WRITE, request, owner, object_key)
        if lease is None:
            return False
        self.leases.remove(lease)
        if how == "commit":
            self.l1.commit(object_key)
            if writes is not None:
                arena = self.arenas.of_key(object_key)
                tenant = "" if arena is None or arena.tenant is None else arena.tenant
                writes.append(L2Write(object_key, fingerprint, tenant))
        elif how == "abort":
            self.l1.abort(object_key)
        else:
            self.l1.abort_quarantined(object_key, self.clock() + self.config.reservation_ttl)
        return True

    # ----------------------------------------------------------------- reads

    def pin_reads(
        self, owner: str, request: RequestKey, chunks: range, keys: Sequence[bytes]
    ) -> list[Slot]:
        """Pin the chunks of a retrieve that are in L1, each before consuming the lookup's pin
        (so it never drops to zero pins in between); a ``read`` slot for each, ``failed`` for
        one that is not in L1, or that ``owner`` is reading for ``request`` already (named
        twice, or retrieved again before its release). A chunk has one read lease per reader
        and request, released once: a second pin on it would end with the first copy's release
        and leave the second copy reading a slot that may be rewritten, and pins piled on one
        lease escape every quota. The caller admitted them (:meth:`admit_reads`)."""
        expires = self.clock() + self.config.pin_ttl
        slots = []
        l1, leases = self.l1, self.leases
        for index, object_key in zip(chunks, keys, strict=False):
            entry = l1.get(object_key)
            if entry is None or leases.get(LeaseKind.READ, request, owner, object_key):
                slots.append(Slot(index, "failed"))
                continue
            l1.pin(object_key)  # the read's own pin first, so the entry stays pinned
            leases.add(LeaseKind.READ, request, owner, object_key, 1, expires)
            consumed = leases.take_lookup(request, object_key)
            if consumed:
                l1.unpin(object_key, consumed)
            slots.append(Slot(index, "read", self.local(entry.offset), entry.nbytes))
        return slots

    def end_reads(self, owner: str, request: RequestKey, object_keys: Sequence[bytes]) -> int:
        """Unpin ``owner``'s read pins of ``object_keys`` for ``request`` that still exist."""
        leases = []
        for object_key in object_keys:
            lease = self.leases.get(LeaseKind.READ, request, owner, object_key)
            if lease is not None:
                self.leases.remove(lease)
                leases.append(lease)
        return self.undo(leases, quarantine=False)

    # ----------------------------------------------------------------- lease ends

    def undo(self, leases: Sequence[Lease], *, quarantine: bool) -> int:
        """Undo what removed leases held: unpin, or drop a reservation. Returns the count.

        ``quarantine`` (the lease expired, or its session went silent): its holder may be slow,
        not dead. A reservation's slot is then reused only ``reservation_ttl`` later, so a late
        write lands nowhere that matters; a read's pin is kept as long, so a late copy out of
        the slot still reads this chunk, never the next one written there (the reaper,
        :meth:`expire`, drops it). A lookup's pin has no copy behind it: unpinned at once."""
        l1 = self.l1
        until = self.clock() + self.config.reservation_ttl
        for lease in leases:
            if lease.kind is LeaseKind.WRITE:
                if quarantine:
                    l1.abort_quarantined(lease.key, until)
                else:
                    l1.abort(lease.key)
            elif quarantine and lease.kind is LeaseKind.READ:
                heapq.heappush(
                    self._held_reads, (until, next(self._held_seq), lease.key, lease.count)
                )
            else:
                l1.unpin(lease.key, lease.count)
        return len(leases)

    def release_slice(self, owner: str, *, quarantine: bool) -> int:
        """Release up to :data:`RELEASE_SLICE` of ``owner``'s leases (a session's end or
        unregistration: call again while it returns :data:`RELEASE_SLICE`)."""
        return self.undo(self.leases.pop_owner(owner, RELEASE_SLICE), quarantine=quarantine)

    def expire(self, now: float) -> tuple[int, float | None]:
        """The reaper's round: undo the leases expired at ``now`` (quarantined: their holder
        may be slow, not dead; see :meth:`undo`), and free the quarantined slots and held read
        pins whose time is over. The count expired, and when the next lease or quarantine ends."""
        expired = self.leases.pop_expired(now)
        if expired:
            self.undo(expired, quarantine=True)
        held = self._held_reads
        while held and held[0][0] <= now:
            _, _, key, count = heapq.heappop(held)
            self.l1.unpin(key, count)
        self.l1.release_quarantine(now)
        ends = (
            self.leases.next_expiry(),
            self.l1.next_quarantine_release(),
            held[0][0] if held else None,
        )
        wakes = [when for when in ends if when is not None]
        return len(expired), min(wakes) if wakes else None
