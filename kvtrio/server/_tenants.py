"""Per-tenant L1 arenas: no tenant's CPU worker maps, reads or evicts another tenant's chunks.

Each tenant gets a shared-memory file of its own (``--l1-size / --l1-tenants`` bytes), with its
own L1 index, allocator and eviction policy. The first arena is created at the server's start
(so a single-tenant server is what it always was) and goes to the first tenant that registers;
later tenants' arenas are created at their first registration, up to ``--l1-tenants``. Beyond
that a new tenant gets the arena of a tenant that is *idle* (nothing registered, nothing pinned
or being written in its arena: the cache core decides, :meth:`TenantArenas.for_tenant`'s
``idle``), or ``quota_exceeded`` if none is. Such an arena is *renewed*, never handed over: its
index is dropped (the KV events' listener told of each chunk, in slices), its file unlinked and
unmapped, and a fresh file (zeros, from the kernel) with a new index takes its place, so no
byte of the old tenant reaches the new one, even through a worker of the old tenant that still
maps the old file. An arena pinned for GPU copies (``keep``) is never renewed.

Inside the server every arena's offsets live in one *virtual* offset space: arena ``i`` starts
at ``i << 44`` (a renewed arena gets the next unused ``i``: an offset of the old one held
anywhere names no arena, never the new tenant's bytes). :class:`TenantL1` (the index) and
:class:`TenantMemory` (the bytes) route by object key and by offset, so the L2 tier, the
prefetcher, quotas and scrubbing work unchanged; only replies to workers carry offsets local to
the worker's own arena (:meth:`TenantArena.local`).
No I/O in the routing; creating an arena creates and sizes a file.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence

import attrs
import numpy as np
import numpy.typing as npt
import trio

from .._logging import event
from ..errors import ErrorCode, RequestError
from ..shm import SharedArena
from ..storage import Entry, L1Cache, L1Listener, L1Stats, Reservation
from ..transport import group_id

__all__ = ["TenantArena", "TenantArenas", "TenantL1", "TenantMemory"]

log = logging.getLogger("kvtrio.tenants")

_SHIFT = 44
"""Arena ``i``'s virtual offsets start at ``i << _SHIFT`` (16 TiB apart)."""
_NAMESPACE_SIZE = 16
"""An object key is a 16-byte namespace (model, tenant, profile, rank) and a chunk hash."""
_GONE_SLICE = 4096
"""Chunks of a renewed arena whose end the KV events' listener hears between two yields."""
_MAX_INDEX = 1 << 19
"""Arena indices stay below this (virtual offsets below 2**63): renewals beyond it are refused."""


@attrs.define(eq=False)
class TenantArena:
    """One tenant's arena file and its L1 index (``tenant`` is None until assigned)."""

    index: int
    arena: SharedArena
    l1: L1Cache
    tenant: str | None = None
    allocated: bool = True
    """False until the pages of an arena created for a tenant are allocated (the first one's
    are allocated by the server's start)."""
    claims: int = 0
    """Registrations of its tenant under way (:meth:`TenantArenas.opened`): never renewed then."""
    keep: bool = False
    """Pinned for GPU copies (a CUDA registration's server-side copies use its mapping): never
    renewed for another tenant."""

    @property
    def base(self) -> int:
        return self.index << _SHIFT

    def local(self, offset: int) -> int:
        """A virtual offset of this arena as an offset into its file."""
        return offset - self.base


class TenantArenas:
    """The server's tenant arenas; ``first`` (created at start) goes to the first tenant."""

    def __init__(
        self,
        first: SharedArena,
        make_l1: Callable[[int, int], L1Cache],
        *,
        limit: int = 1,
        directory: str | None = None,
        group: str = "",
    ) -> None:
        self.arena_size = first.size
        self._allocate = trio.CapacityLimiter(1)
        """Allocating the pages of tenants' arenas (and unmapping renewed ones) runs one arena
        at a time."""
        self.limit = limit
        self._make_l1 = make_l1
        self._directory = directory
        self._group = group
        share(first, group)
        self.all: list[TenantArena] = [TenantArena(0, first, make_l1(first.size, 0))]
        """The live arenas (at most ``limit``)."""
        self._by_index: dict[int, TenantArena] = {0: self.all[0]}
        self._next_index = 1
        self._by_tenant: dict[str, TenantArena] = {}
        self._by_space: dict[bytes, TenantArena] = {}
        self._gone: list[tuple[L1Listener, list[bytes]]] = []
        """Listeners of renewed arenas' indexes, and the keys they are yet to hear are gone."""
        self._retired_arenas: list[SharedArena] = []
        """Renewed arenas' files, unmapped and removed in a worker thread (:meth:`opened`):
        unmapping a populated arena takes ~84 ms per GiB, too long for the event loop."""
        self.retired = L1Stats(0, 0, 0, 0, 0, 0, 0, 0, 0)
        """The counters (evictions, store failures) of renewed arenas' indexes, kept so that
        the sums in ``stats`` never go down."""
        self.renewed = 0
        """Arenas taken from an idle tenant and renewed for another."""
        self.l1 = TenantL1(self)
        self.memory = TenantMemory(self)

    @property
    def first(self) -> SharedArena:
        return self.all[0].arena

    def tenant_count(self) -> int:
        """Tenants that have an arena now."""
        return len(self._by_tenant)

    def for_tenant(
        self, tenant: str, idle: Callable[[TenantArena], bool] = lambda _: False
    ) -> TenantArena:
        """The tenant's arena: its own, else an unassigned one, else a new one (up to
        ``limit``), else the arena of a tenant for which ``idle`` is true, renewed
        (:meth:`_renew`).

        Raises ``quota_exceeded`` if none is left, ``internal`` if a file cannot be created.
        Synchronous: creating and sizing a tmpfs file takes microseconds.
        """
        found = self._by_tenant.get(tenant)
        if found is not None:
            return found
        spare = next((a for a in self.all if a.tenant is None), None)
        if spare is None and len(self.all) < self.limit:
            spare = self._new_arena()
            self.all.append(spare)
        if spare is None:
            old = next(
                (a for a in self.all if not a.keep and a.claims == 0 and idle(a)),
                None,
            )
            if old is None:
                raise RequestError(
                    ErrorCode.QUOTA_EXCEEDED,
                    f"this server's L1 is split into {self.limit} tenant arena(s), all in use "
                    "(each by a tenant with registered workers or chunks in use): start it "
                    "with a larger --l1-tenants, or retry once a tenant's workers are gone",
                )
            spare = self._renew(old)
        spare.tenant = tenant
        self._by_tenant[tenant] = spare
        log.info(
            "tenant arena %d (%s) for a tenant",
            spare.index,
            spare.arena.path,
            extra=event("tenant_arena", index=spare.index, bytes=spare.arena.size),
        )
        return spare

    def _new_arena(self) -> TenantArena:
        """A new arena file with the next index (its pages not allocated yet)."""
        index = self._next_index
        if index >= _MAX_INDEX:
            raise RequestError(
                ErrorCode.QUOTA_EXCEEDED,
                f"this server has renewed tenant arenas {self.renewed} times: restart it",
            )
        try:
            arena = SharedArena.create(self.arena_size, directory=self._directory)
            share(arena, self._group)
        except OSError as exc:
            raise RequestError(
                ErrorCode.INTERNAL, f"cannot create a tenant's L1 arena: {exc.strerror}"
            ) from None
        self._next_index += 1
        created = TenantArena(
            index, arena, self._make_l1(arena.size, index << _SHIFT), allocated=False
        )
        self._by_index[index] = created
        return created

    def _renew(self, old: TenantArena) -> TenantArena:
        """Replace an idle tenant's arena by a fresh one in its place (see the module doc).

        The caller checked that nothing in it is pinned or being written: no task holds an
        offset into it. Its index is dropped whole (O(1): dropping 100k entries one by one
        held the loop 1–3 s) and its listener told of each chunk later (:meth:`_tell_gone`),
        its namespaces unbound, its file unlinked and unmapped in a worker thread later
        (:meth:`_close_retired`).
        """
        fresh = self._new_arena()
        if old.tenant is not None:
            del self._by_tenant[old.tenant]
        for space in [s for s, a in self._by_space.items() if a is old]:
            del self._by_space[space]
        if old.l1.listener is not None:  # (told by :meth:`_tell_gone`, a slice at a time)
            self._gone.append((old.l1.listener, old.l1.entry_keys()))
        gone = old.l1.stats()
        self.retired = attrs.evolve(
            self.retired,
            evictions=self.retired.evictions + gone.evictions,
            store_failures=self.retired.store_failures + gone.store_failures,
        )
        del self._by_index[old.index]
        self.all[self.all.index(old)] = fresh
        self._retired_arenas.append(old.arena)
        self.renewed += 1
        log.info(
            "tenant arena %d renewed as %d: its tenant had nothing registered or in use",
            old.index,
            fresh.index,
            extra=event("tenant_arena_renewed", index=old.index, new_index=fresh.index),
        )
        return fresh

    @contextlib.asynccontextmanager
    async def opened(
        self, tenant: str, idle: Callable[[TenantArena], bool] = lambda _: False
    ) -> AsyncIterator[TenantArena]:
        """:meth:`for_tenant`, claimed (never renewed) until the block ends; a new arena's
        pages are allocated first, in a worker thread (tmpfs allocates on first write
        otherwise: a full ``/dev/shm`` would SIGBUS the writer later).

        A failure to allocate is logged, not raised, as at the start. Cancellation: the thread
        is abandoned and finishes by itself; the claim ends.
        """
        tenant_arena = self.for_tenant(tenant, idle)
        tenant_arena.claims += 1
        try:
            await self._tell_gone()
            await self._close_retired()
            if not tenant_arena.allocated:
                tenant_arena.allocated = True
                try:
                    await trio.to_thread.run_sync(
                        tenant_arena.arena.preallocate,
                        limiter=self._allocate,
                        abandon_on_cancel=True,
                    )
                except OSError as exc:
                    log.error("could not allocate a tenant L1 arena's memory: %s", exc.strerror)
            yield tenant_arena
        finally:
            tenant_arena.claims -= 1

    async def _close_retired(self) -> None:
        """Unmap and remove renewed arenas' files in a worker thread, one at a time.
        Cancellation: the thread is abandoned and finishes the close by itself."""
        while self._retired_arenas:
            arena = self._retired_arenas.pop()
            await trio.to_thread.run_sync(
                arena.close, limiter=self._allocate, abandon_on_cancel=True
            )

    async def _tell_gone(self) -> None:
        """Tell the listeners (KV events) of renewed arenas that their chunks are gone,
        :data:`_GONE_SLICE` at a time with a yield in between. Cancellation: at a yield; the
        rest is told by the next call."""
        while self._gone:
            listener, keys = self._gone[-1]
            for key in keys[-_GONE_SLICE:]:
                listener.removed(key)
            del keys[-_GONE_SLICE:]
            if not keys:
                self._gone.pop()
            await trio.lowlevel.checkpoint()

    def bind(self, space: bytes, tenant_arena: TenantArena) -> None:
        """Objects of namespace ``space`` live in ``tenant_arena`` (a space names one tenant)."""
        self._by_space[space] = tenant_arena

    def of_key(self, key: bytes) -> TenantArena | None:
        return self._by_space.get(key[:_NAMESPACE_SIZE])

    def of_offset(self, offset: int) -> TenantArena:
        found = self._by_index.get(offset >> _SHIFT)
        if found is None:
            raise ValueError(f"offset {offset} is in no arena")
        return found

    def close(self) -> None:
        """Unmap and remove every arena file (the start's one too, and renewed ones not yet
        closed)."""
        for tenant_arena in self.all:
            tenant_arena.arena.close()
        while self._retired_arenas:
            self._retired_arenas.pop().close()


def share(arena: SharedArena, group: str) -> None:
    """Let ``group`` (``--ipc-group``) map the arena too (0660); without a group it stays 0600."""
    if not group:
        return
    gid = group_id(group)  # (a name or a numeric id: checked with the settings)
    with contextlib.suppress(FileNotFoundError):
        os.chown(arena.path, -1, gid)
        os.chmod(arena.path, 0o660)


class TenantL1(L1Cache):
    """The L1 index of every tenant arena, routed by object key (its namespace).

    A key whose namespace no registration has bound is in no arena: it is never found, and a
    reservation of it fails (``NO_SPACE``).
    """

    def __init__(self, arenas: TenantArenas) -> None:  # no L1Cache state of its own
        self._arenas = arenas
        self.evictions = 0
        self.store_failures = 0

    def _of(self, key: bytes) -> L1Cache:
        tenant_arena = self._arenas.of_key(key)
        if tenant_arena is None:
            raise KeyError(key)
        return tenant_arena.l1

    @property
    def capacity(self) -> int:
        return self._arenas.arena_size

    def index_for(self, key: bytes) -> L1Cache:
        return self._of(key)

    def get(self, key: bytes) -> Entry | None:
        tenant_arena = self._arenas.of_key(key)
        return None if tenant_arena is None else tenant_arena.l1.get(key)

    def prefix(self, keys: Sequence[bytes]) -> int:
        tenant_arena = self._arenas.of_key(keys[0]) if keys else None
        return 0 if tenant_arena is None else tenant_arena.l1.prefix(keys)

    def pin(self, key: bytes, count: int = 1) -> Entry:
        return self._of(key).pin(key, count)

    def unpin(self, key: bytes, count: int = 1) -> None:
        self._of(key).unpin(key, count)

    def reserve(
        self, key: bytes, nbytes: int, *, parent: bytes | None = None
    ) -> Entry | Reservation:
        tenant_arena = self._arenas.of_key(key)
        if tenant_arena is None:
            return Reservation.NO_SPACE
        return tenant_arena.l1.reserve(key, nbytes, parent=parent)

    def commit(self, key: bytes) -> None:
        self._of(key).commit(key)

    def abort(self, key: bytes) -> None:
        self._of(key).abort(key)

    def abort_quarantined(self, key: bytes, until: float) -> None:
        self._of(key).abort_quarantined(key, until)

    def release_quarantine(self, now: float) -> int:
        return sum(a.l1.release_quarantine(now) for a in self._arenas.all)

    def next_quarantine_release(self) -> float | None:
        times = [a.l1.next_quarantine_release() for a in self._arenas.all]
        return min((t for t in times if t is not None), default=None)

    def discard(self, key: bytes) -> bool:
        tenant_arena = self._arenas.of_key(key)
        return tenant_arena is not None and tenant_arena.l1.discard(key)

    def stats(self) -> L1Stats:
        """The sum over the arenas (and the counters of renewed ones)."""
        parts = [a.l1.stats() for a in self._arenas.all] + [self._arenas.retired]
        fields = attrs.fields(L1Stats)
        return L1Stats(**{f.name: sum(getattr(p, f.name) for p in parts) for f in fields})


class TenantMemory(SharedArena):
    """The bytes of every tenant arena, addressed by virtual offset (server side only)."""

    def __init__(self, arenas: TenantArenas) -> None:  # maps nothing of its own
        self._arenas = arenas
        self.path = ""
        self.size = arenas.arena_size * arenas.limit  # all of L1 (the L2 tier sizes its queue)
        self.buffer = np.empty(0, dtype=np.uint8)

    def _at(self, offset: int) -> tuple[SharedArena, int]:
        tenant_arena = self._arenas.of_offset(offset)
        return tenant_arena.arena, tenant_arena.local(offset)

    def view(self, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        arena, local = self._at(offset)
        return arena.view(local, nbytes)

    def memory(self, offset: int, nbytes: int) -> memoryview:
        arena, local = self._at(offset)
        return arena.memory(local, nbytes)

    def preallocate(self) -> None:
        for tenant_arena in self._arenas.all:
            tenant_arena.arena.preallocate()

    def close(self) -> None:
        self._arenas.close()

    def __repr__(self) -> str:
        return f"<TenantMemory {len(self._arenas.all)} arenas of {self._arenas.arena_size} bytes>"
