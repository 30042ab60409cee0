"""The cache operations: register, lookup, store/commit, retrieve/release, request ends.

All state changes happen synchronously inside a handler (no checkpoint in the middle), so each
operation is atomic with respect to every other. Every pin and reservation is a lease
(``storage.LeaseTable``) undone exactly once: by the operation that ends it, by the request's
end, by its session's end, or by the reaper when it expires.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import trio

from .._logging import event
from ..config import ServerConfig
from ..errors import ErrorCode, RequestError
from ..protocol import (
    CacheStats,
    Commit,
    CommitReply,
    EndSession,
    FreeLookupLocks,
    Lookup,
    LookupReply,
    Register,
    Registered,
    Release,
    Released,
    Retrieve,
    RetrieveReply,
    Slot,
    Store,
    StoreReply,
    Unregister,
)
from ..storage import (
    Entry,
    L1Cache,
    Lease,
    LeaseKind,
    LeaseTable,
    Reservation,
)
from ._batch import register_lookup_batch
from ._cuda import CudaTransfers
from ._l2 import L2Tier
from ._limits import RequestLimits, check_registration
from ._prefetch import Prefetcher
from ._quotas import Quotas, scrub, scrub_now
from ._registry import Registration, Registry, request_key
from ._session import Session
from ._state import Later, ServerState
from ._tenants import TenantArenas

__all__ = ["CacheService"]

log = logging.getLogger("kvtrio.cache")

CHUNK_HASH_SIZE = 16

_REAPER_PERIOD = 1.0
"""Longest sleep of the reaper; leases expire at most this late."""


class CacheService:
    """The L1 cache behind the protocol's cache operations. One per server."""

    def __init__(
        self,
        state: ServerState,
        arenas: TenantArenas,
        l2: L2Tier,
        cuda: CudaTransfers | None = None,
    ) -> None:
        self.state = state
        self.cuda = cuda if cuda is not None else CudaTransfers(arenas.first)
        self.config: ServerConfig = state.config
        self.arenas = arenas  # one per tenant (docs/security.md)
        self.arena = arenas.memory
        self.l1: L1Cache = arenas.l1
        self.l2 = l2
        self.lookup_l2_chunks = 0
        self.lookup_timeouts = 0
        self.leases = LeaseTable()
        self.quotas = Quotas(state, self.leases, self.l1)
        self.registry = Registry(state.config.chunk_size)
        self.limits = RequestLimits(state.config.max_requests, state.config.max_pins)
        self._watched: set[str] = set()  # sessions whose end releases their leases
        self.prefetch = Prefetcher(self.l1, l2, state.config, self._pin_for_lookup)
        self.lookups = 0
        self.lookup_hit_chunks = 0
        self.lookup_miss_chunks = 0

    def install(self) -> None:
        """Register the handlers with the server (lookup runs concurrently)."""
        state = self.state
        state.register(Register, self.register)
        state.register(Unregister, self.unregister)
        # Inline: answered in the router's round; a Later part (L2, a large scrub) in a task.
        state.register_inline(Lookup, self.lookup, concurrent=True)
        register_lookup_batch(state, self.lookup)
        state.register_inline(Store, self.store)
        state.register_inline(Commit, self.commit)
        state.register_inline(Retrieve, self.retrieve)  # (waiting for L2 loads: a Later)
        state.register_inline(Release, self.release)
        state.register_inline(FreeLookupLocks, self.free_lookup_locks)
        state.register_inline(EndSession, self.end_session)
        state.cache_stats = self.stats
        state.l2_stats = self.l2.stats

    # ----------------------------------------------------------------- registration

    async def register(self, session: Session, request: Register) -> Registered:
        check_registration(request, self.config.chunk_size, self.arenas.arena_size)
        tenant_arena = await self.arenas.open(request.tenant)
        if request.device == "cuda" and tenant_arena.index != 0:
            raise RequestError(
                ErrorCode.INCOMPATIBLE,
                "CUDA workers are served in the first tenant's L1 arena only (not yet per tenant)",
            )
        released = self._drop_registration(session.id, quarantine=False)
        registration = self.registry.register(session.id, request)
        self.arenas.bind(registration.space, tenant_arena)
        self._watch(session)
        if registration.device == "cuda":
            try:
                registration.cuda = await self.cuda.open(
                    request.cuda, registration.layout, registration.chunk_bytes
                )
            except BaseException:
                self.registry.unregister(session.id)
                raise
        log.info(
            "session %s registered %s rank %d/%d (%s, %s)%s",
            session.id,
            request.model,
            request.rank,
            request.world_size,
            request.layout.kind,
            request.layout.dtype,
            f", replacing its registration ({released} released)" if released else "",
            extra=event(
                "registration",
                session=session.id,
                model=request.model,
                rank=request.rank,
                world_size=request.world_size,
                layout=request.layout.kind,
                dtype=request.layout.dtype,
            ),
        )
        config = self.config
        return Registered(
            chunk_size=config.chunk_size,
            arena_path=tenant_arena.arena.path,  # its own tenant's arena, never another's
            arena_size=tenant_arena.arena.size,
            chunk_bytes=registration.chunk_bytes,
            reservation_ttl=config.reservation_ttl,
            pin_ttl=config.pin_ttl,
        )

    async def unregister(self, session: Session, request: Unregister) -> Released:
        return Released(self._drop_registration(session.id, quarantine=False))

    def _drop_registration(self, session_id: str, *, quarantine: bool) -> int:
        self.prefetch.cancel_owner(session_id)
        registration = self.registry.unregister(session_id)
        # The server's own GPU copies may still be writing a CUDA worker's reservations.
        cuda = registration is not None and registration.cuda is not None
        released = self._undo(self.leases.pop_owner(session_id), quarantine=quarantine or cuda)
        if registration is not None and registration.cuda is not None:
            self.cuda.close(registration.cuda)  # once the copies queued so far are done
        if registration is not None:
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

    def _watch(self, session: Session) -> None:
        """Make the session's end release everything it holds (once per session)."""
        if session.id in self._watched:
            return
        self._watched.add(session.id)

        async def session_ended() -> None:
            self._watched.discard(session.id)
            # The client may still be alive (silent, not dead): a late write must land in a
            # quarantined slot, never in one handed to someone else.
            self._drop_registration(session.id, quarantine=True)

        session.add_cleanup(session_ended)

    def _registration(self, session: Session) -> Registration:
        registration = self.registry.by_session.get(session.id)
        if registration is None:
            raise RequestError(
                ErrorCode.NOT_REGISTERED,
                "this client has not registered a KV cache (or its session ended): register first",
            )
        return registration

    # ----------------------------------------------------------------- lookup

    def lookup(self, session: Session, request: Lookup) -> LookupReply | Later:
        """Pin the L1 prefix now; L2 work, if any, is left to a :class:`Later`."""
        self.cuda.settle()  # CUDA stores the worker already saw done are visible
        hashes = _checked_hashes(request.chunk_hashes)
        model = self.registry.engine_model(request.engine, request.model, request.tenant)
        if model is None:
            return LookupReply(0, 0)  # no worker of this engine has registered (yet)
        if request.world_size != model.world_size:
            raise RequestError(
                ErrorCode.INCOMPATIBLE,
                f"model {request.model!r} is registered with world size {model.world_size}, "
                f"the lookup says {request.world_size}",
            )
        now = trio.current_time()
        key = request_key(request.engine, request.model, request.tenant, request.request)
        self.limits.admit_request(self.leases, key)
        # A new lookup of the request replaces the previous one: its pins and its loads.
        self._end_lookup(key)
        self.quotas.readers(request.num_readers, model.world_size)
        hit = len(hashes)
        for space in model.spaces:
            hit = self.l1.prefix([space + h for h in hashes[:hit]])
        if hit:
            pinned = [space + h for space in model.spaces for h in hashes[:hit]]
            self.quotas.admit(session, len(pinned), self._chunk_bytes(model.spaces))
            self.quotas.admit_pins(pinned, self._chunk_bytes(model.spaces))
        self.limits.admit_pins(self.leases, len(hashes) * len(model.spaces))  # (L2 hits too)
        readers = request.num_readers or (
            model.world_size if model.profile.shared_across_ranks else 1
        )
        expires = now + self.config.pin_ttl
        for chunk_hash in hashes[:hit]:  # pinned before awaiting anything: they stay
            for space in model.spaces:
                self._pin_for_lookup(key, session.id, space + chunk_hash, readers, expires)
        self._watch(session)
        if self.l2.enabled and hit < len(hashes):
            return Later(lambda: self._lookup_l2(session, key, model, hashes, hit, readers))
        return self._lookup_done(len(hashes), hit, 0)

    async def _lookup_l2(
        self,
        session: Session,
        key: str,
        model: Any,
        hashes: Sequence[bytes],
        hit: int,
        readers: int,
    ) -> LookupReply:
        """The L2 part of a lookup: find the missing chunks there and start their loads."""
        sources: list[list[Any]] = []
        with trio.move_on_after(self.config.lookup_timeout) as scope:
            sources = await self.l2.lookup(model.spaces, hashes[hit:])
        if scope.cancelled_caught:
            self.lookup_timeouts += 1  # (l2.lookup unlocked what it had locked)
        loaded = await self.prefetch.start(
            session.id,
            key,
            model.spaces,
            hashes[hit : hit + len(sources)],
            sources,
            readers,
            model.profile.digest(),
            self._chunk_bytes(model.spaces),
        )
        return self._lookup_done(len(hashes), hit, loaded)

    def _lookup_done(self, chunks: int, hit: int, loaded: int) -> LookupReply:
        self.lookups += 1
        self.lookup_hit_chunks += hit + loaded
        self.lookup_l2_chunks += loaded
        self.lookup_miss_chunks += chunks - hit - loaded
        total = hit + loaded
        return LookupReply(hit_tokens=total * self.config.chunk_size, hit_chunks=total)

    def _pin_for_lookup(
        self, key: str, owner: str, object_key: bytes, readers: int, expires: float
    ) -> None:
        self.l1.pin(object_key, readers)
        self.leases.add(LeaseKind.LOOKUP, key, owner, object_key, readers, expires)

    def _end_lookup(self, key: str) -> int:
        """Release a request's lookup pins and cancel its pending loads."""
        self.prefetch.cancel_request(key)
        return self._undo(self.leases.pop_request(key, [LeaseKind.LOOKUP]), quarantine=False)

    def _chunk_bytes(self, spaces: Sequence[bytes]) -> int:
        for registration in self.registry.by_session.values():
            if registration.space in spaces:
                return registration.chunk_bytes
        raise RequestError(ErrorCode.INCOMPATIBLE, "no worker of this model is registered")

    # ----------------------------------------------------------------- store

    def store(self, session: Session, request: Store) -> StoreReply | Later:
        """Reserve the slots now; zeroing too many bytes to do inline is left to a Later."""
        registration = self._registration(session)
        key, hashes, chunks = self._chunks(registration, request)
        if registration.cuda is not None:
            blocks = self._block_ids(registration, request, chunks, store=True)
        self.quotas.admit(session, len(chunks), registration.chunk_bytes)
        expires = trio.current_time() + self.config.reservation_ttl
        self.limits.admit_pins(self.leases, len(chunks))
        slots = []
        reserved = []
        parent: bytes | None = None  # the range's first chunk's parent, if the client knows it
        if request.parent_hash:
            parent = registration.space + _checked_hashes((request.parent_hash,), "parent_hash")[0]
        for index, chunk_hash in zip(chunks, hashes, strict=True):
            object_key = registration.space + chunk_hash
            outcome = self.l1.reserve(object_key, registration.chunk_bytes, parent=parent)
            parent = object_key
            if isinstance(outcome, Entry):
                self.leases.add(LeaseKind.WRITE, key, session.id, object_key, 1, expires)
                slots.append(Slot(index, "write", self._local(outcome.offset), outcome.nbytes))
                reserved.append(outcome)
            elif outcome is Reservation.PRESENT:
                slots.append(Slot(index, "present"))
            elif outcome is Reservation.IN_PROGRESS:
                slots.append(Slot(index, "busy"))
            else:
                slots.append(Slot(index, "failed"))
        if registration.cuda is not None:
            return self._cuda_store(session, registration, request, key, hashes, blocks, slots)
        reply = StoreReply(tuple(slots), self.config.reservation_ttl)
        # An unwritten slot never shows a previous chunk.
        if scrub_now(self.arena, reserved):
            return reply
        return Later(lambda: self._scrubbed(reserved, reply))

    async def _scrubbed(self, reserved: list[Entry], reply: StoreReply) -> StoreReply:
        await scrub(self.arena, reserved)
        return reply

    def commit(self, session: Session, request: Commit) -> CommitReply:
        registration = self._registration(session)
        key = self._worker_request(registration, request.request)
        committed, rejected = 0, []
        written = _checked_hashes(request.written, "written")
        failed = _checked_hashes(request.failed, "failed")
        for chunk_hash, ok in [(h, True) for h in written] + [(h, False) for h in failed]:
            object_key = registration.space + chunk_hash
            lease = self.leases.get(LeaseKind.WRITE, key, session.id, object_key)
            if lease is None:
                if ok:
                    rejected.append(chunk_hash)  # never reserved, or the reservation expired
                continue
            self.leases.remove(lease)
            if ok:
                self.l1.commit(lease.key)
                self.l2.write_behind(lease.key, registration.profile.digest())
                committed += 1
            else:
                self.l1.abort(lease.key)
        return CommitReply(committed, tuple(rejected))

    # ----------------------------------------------------------------- retrieve

    def retrieve(self, session: Session, request: Retrieve) -> RetrieveReply | Later:
        """Pin and answer the slots now; waiting for the chunks' L2 loads is left to a Later.

        A ``partial`` retrieve waits only for its first chunk's load and answers the chunks
        still loading after the ready ones as ``loading`` (see ``_read``)."""
        self.cuda.settle()
        registration = self._registration(session)
        key, hashes, chunks = self._chunks(registration, request)
        blocks: list[list[int]] = []
        if registration.cuda is not None:
            blocks = self._block_ids(registration, request, chunks, store=False)
        keys = [registration.space + h for h in hashes]
        pending = self.prefetch.pending(key, keys[:1] if request.partial else keys)
        if not pending:
            return self._read(session, registration, request, key, hashes, chunks, blocks)
        # L2 → L1 loads started by the lookup: wait for them, within the deadline, which the
        # retrieves of this request share while its loads last (a worker may split one
        # operation into several retrieves: they wait once, not once each).
        deadline = self.prefetch.wait_deadline(
            key, registration.space, trio.current_time() + self.config.retrieve_timeout
        )

        async def loaded() -> RetrieveReply:
            with trio.move_on_at(deadline):
                for load in pending:
                    await load.done.wait()
            return self._read(session, registration, request, key, hashes, chunks, blocks)

        return Later(loaded)

    def _loading_from(self, key: str, keys: Sequence[bytes], space: bytes) -> int:
        """A partial retrieve's answer: the index of its first chunk whose load is still
        running (``len(keys)`` if none is, or once the request's wait is over)."""
        deadline = self.prefetch.deadline(key, space)
        if deadline is not None and trio.current_time() >= deadline:
            return len(keys)
        for index, object_key in enumerate(keys):
            if self.prefetch.pending(key, [object_key]):
                return index
        return len(keys)

    def _read(
        self,
        session: Session,
        registration: Registration,
        request: Retrieve,
        key: str,
        hashes: Sequence[bytes],
        chunks: range,
        blocks: list[list[int]],
    ) -> RetrieveReply:
        """Pin the chunks of a retrieve that are in L1 (consuming the lookup's pins). A partial
        retrieve answers ``loading`` from its first chunk still loading on (not pinned)."""
        reading = [registration.space + h for h in hashes]
        ready = len(reading)
        if request.partial and self.prefetch.pending_count:
            ready = self._loading_from(key, reading, registration.space)
        reading, hashes = reading[:ready], hashes[:ready]
        self.quotas.admit(session, ready, registration.chunk_bytes)
        self.quotas.admit_pins(reading, registration.chunk_bytes)
        expires = trio.current_time() + self.config.pin_ttl
        slots = []
        for index, chunk_hash in zip(chunks, hashes, strict=False):
            object_key = registration.space + chunk_hash
            entry = self.l1.get(object_key)
            if entry is None:
                slots.append(Slot(index, "failed"))
                continue
            self.l1.pin(object_key)  # the read's own pin first, so the entry stays pinned
            self.leases.add(LeaseKind.READ, key, session.id, object_key, 1, expires)
            consumed = self.leases.take_lookup(key, object_key)
            if consumed:
                self.l1.unpin(object_key, consumed)
            slots.append(Slot(index, "read", self._local(entry.offset), entry.nbytes))
        slots += [Slot(index, "loading") for index in chunks[ready:]]
        if registration.cuda is not None:
            return self._cuda_retrieve(session, registration, request, key, hashes, blocks, slots)
        return RetrieveReply(tuple(slots))

    def release(self, session: Session, request: Release) -> Released:
        registration = self._registration(session)
        key = self._worker_request(registration, request.request)
        leases = []
        for chunk_hash in _checked_hashes(request.chunk_hashes, "chunk_hashes"):
            object_key = registration.space + chunk_hash
            lease = self.leases.get(LeaseKind.READ, key, session.id, object_key)
            if lease is not None:
                self.leases.remove(lease)
                leases.append(lease)
        return Released(self._undo(leases, quarantine=False))

    # ----------------------------------------------------------------- request ends

    def free_lookup_locks(self, session: Session, request: FreeLookupLocks) -> Released:
        key = request_key(request.engine, request.model, request.tenant, request.request)
        return Released(self._end_lookup(key))

    def end_session(self, session: Session, request: EndSession) -> Released:
        # A worker's store or retrieve may still be under way (engines save asynchronously):
        # its reservations and read pins are its own leases, ended by its commit/release.
        key = request_key(request.engine, request.model, request.tenant, request.request)
        return Released(self._end_lookup(key))

    # ----------------------------------------------------------------- CUDA workers

    def _block_ids(
        self, registration: Registration, request: Store | Retrieve, chunks: range, *, store: bool
    ) -> list[list[int]]:
        """The engine blocks of each chunk of a CUDA worker's store or retrieve, checked."""
        per_chunk = self.config.chunk_size // registration.layout.block_size
        ids = request.block_ids
        if len(ids) < len(chunks) * per_chunk:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"block_ids: {len(chunks)} chunks of {per_chunk} blocks need "
                f"{len(chunks) * per_chunk} block ids, got {len(ids)}",
            )
        used = list(ids[: len(chunks) * per_chunk])
        lowest = -1 if not store else 0
        num_blocks = registration.layout.num_blocks
        if any(type(b) is not int or not lowest <= b < num_blocks for b in used):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"block_ids must be ints in [{lowest}, {num_blocks})"
                + ("" if store else " (-1: a block the engine keeps)"),
            )
        if not store:
            named = [b for b in used if b >= 0]
            if len(set(named)) != len(named):
                raise RequestError(ErrorCode.BAD_REQUEST, "block_ids of a retrieve must differ")
        return [used[i * per_chunk : (i + 1) * per_chunk] for i in range(len(chunks))]

    def _cuda_store(
        self,
        session: Session,
        registration: Registration,
        request: Store,
        key: str,
        hashes: Sequence[bytes],
        blocks: list[list[int]],
        slots: list[Slot],
    ) -> StoreReply:
        """Queue the GPU → L1 copies of the ``write`` slots; commit them once they are done."""
        first = slots[0].chunk if slots else 0
        writes = [slot for slot in slots if slot.status == "write"]
        object_keys = [registration.space + hashes[slot.chunk - first] for slot in writes]
        digest = registration.profile.digest()

        def complete(ok: bool) -> None:
            for object_key in object_keys:
                lease = self.leases.get(LeaseKind.WRITE, key, session.id, object_key)
                if lease is None:
                    continue  # expired or the session ended: quarantined, never committed
                self.leases.remove(lease)
                if ok:
                    self.l1.commit(object_key)
                    self.l2.write_behind(object_key, digest)
                else:
                    self.l1.abort_quarantined(
                        object_key, trio.current_time() + self.config.reservation_ttl
                    )

        if not writes:
            return StoreReply(tuple(slots), self.config.reservation_ttl)
        chunks = [(blocks[s.chunk - first], s.offset, s.nbytes) for s in writes]
        try:
            done = self.cuda.submit(registration.cuda, chunks, request.event, complete, store=True)
        except RequestError:
            for object_key in object_keys:  # nothing was queued
                lease = self.leases.get(LeaseKind.WRITE, key, session.id, object_key)
                if lease is not None:
                    self.leases.remove(lease)
                    self.l1.abort(object_key)
            raise
        if not done:  # queueing failed: nothing of it will be committed
            slots = [Slot(s.chunk, "failed") if s.status == "write" else s for s in slots]
        return StoreReply(tuple(slots), self.config.reservation_ttl, done_event=done)

    def _cuda_retrieve(
        self,
        session: Session,
        registration: Registration,
        request: Retrieve,
        key: str,
        hashes: Sequence[bytes],
        blocks: list[list[int]],
        slots: list[Slot],
    ) -> RetrieveReply:
        """Queue the L1 → GPU copies of the ``read`` slots; unpin them once they are done."""
        first = slots[0].chunk if slots else 0
        reads = [slot for slot in slots if slot.status == "read"]
        object_keys = [registration.space + hashes[slot.chunk - first] for slot in reads]

        def complete(ok: bool) -> None:
            leases = []
            for object_key in object_keys:
                lease = self.leases.get(LeaseKind.READ, key, session.id, object_key)
                if lease is not None:
                    self.leases.remove(lease)
                    leases.append(lease)
            self._undo(leases, quarantine=False)

        if not reads:
            return RetrieveReply(tuple(slots))
        chunks = [(blocks[s.chunk - first], s.offset, s.nbytes) for s in reads]
        try:
            done = self.cuda.submit(registration.cuda, chunks, request.event, complete, store=False)
        except RequestError:
            complete(True)  # nothing was queued: unpin now
            raise
        if not done:  # queueing failed: the engine must recompute these chunks
            return RetrieveReply(
                tuple(Slot(s.chunk, "failed") if s.status == "read" else s for s in slots)
            )
        return RetrieveReply(tuple(slots), done_event=done)

    # ----------------------------------------------------------------- shared pieces

    def _worker_request(self, registration: Registration, request: str) -> str:
        """A worker's requests are its engine's: scoped by engine, model and tenant."""
        return request_key(registration.engine, registration.model, registration.tenant, request)

    def _chunks(
        self, registration: Registration, request: Store | Retrieve
    ) -> tuple[str, Sequence[bytes], range]:
        """The request key, the chunk hashes and the chunk indices of ``[start, end)``."""
        size = self.config.chunk_size
        if request.start % size or request.start < 0 or request.end < request.start:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"the range [{request.start}, {request.end}) must start at a multiple of the "
                f"chunk size {size} and not end before it starts",
            )
        chunks = range(request.start // size, request.end // size)
        hashes = _checked_hashes(request.chunk_hashes)
        if len(hashes) != len(chunks):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"the range [{request.start}, {request.end}) has {len(chunks)} full chunks; "
                f"send exactly their {len(chunks)} chunk hashes (got {len(hashes)})",
            )
        key = self._worker_request(registration, request.request)
        self.limits.admit_request(self.leases, key)
        return key, hashes, chunks

    def _local(self, offset: int) -> int:
        """An L1 entry's offset in its tenant's arena file (what the worker maps)."""
        return self.arenas.of_offset(offset).local(offset)

    def _undo(self, leases: Sequence[Lease], *, quarantine: bool) -> int:
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

    # ----------------------------------------------------------------- the reaper

    async def serve_reaper(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Expire leases, free quarantined slots, forget idle requests; never returns.

        Expired write reservations are quarantined (their writer may be slow, not dead).
        """
        task_status.started()
        while True:
            now = trio.current_time()
            expired = self.leases.pop_expired(now)
            if expired:
                log.warning(
                    "%d leases expired (clients that neither released nor ended them)",
                    len(expired),
                    extra=event("leases_expired", count=len(expired)),
                )
                self._undo(expired, quarantine=True)
            self.l1.release_quarantine(now)
            wake = now + _REAPER_PERIOD
            for when in (self.leases.next_expiry(), self.l1.next_quarantine_release()):
                if when is not None:
                    wake = min(wake, when)
            await trio.sleep_until(wake)

    def stats(self) -> CacheStats:
        l1 = self.l1.stats()
        return CacheStats(
            l1_capacity_bytes=l1.capacity_bytes,
            l1_used_bytes=l1.used_bytes,
            l1_entries=l1.entries,
            l1_ready=l1.ready,
            l1_writing=l1.writing,
            l1_pinned_entries=l1.pinned_entries,
            l1_pins=l1.pins,
            l1_evictions=l1.evictions,
            store_failures=l1.store_failures,
            leases=self.leases.live,
            leases_expired=self.leases.expired_total,
            registrations=len(self.registry.by_session),
            requests=self.leases.requests,
            lookups=self.lookups,
            lookup_hit_chunks=self.lookup_hit_chunks,
            lookup_miss_chunks=self.lookup_miss_chunks,
            lookup_l2_chunks=self.lookup_l2_chunks,
            lookup_timeouts=self.lookup_timeouts,
            loads_pending=self.prefetch.pending_count,
            loads_failed=self.prefetch.failed,
            write_behind_queued=self.l2.queued,
            write_behind_skipped=self.l2.skipped_stores,
            l2_corrupt=self.l2.corrupt,
        )


def _checked_hashes(hashes: Sequence[bytes], name: str = "chunk_hashes") -> Sequence[bytes]:
    """Chunk hashes as sent: each exactly 16 bytes, else ``bad_request``."""
    if any(len(h) != CHUNK_HASH_SIZE for h in hashes):
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"{name}: every chunk hash is {CHUNK_HASH_SIZE} bytes"
        )
    return hashes
