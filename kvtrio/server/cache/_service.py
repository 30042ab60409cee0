"""The cache service: the cache operations assembled, their handlers installed, the reaper, stats.

One per server. The operations live one concern per module (``_registrations``, ``_lookups``,
``_writes``, ``_reads``) over a shared :class:`~._io.CacheIO`, itself over the I/O-free
:class:`~._core.CacheCore`; this module builds them (complete: the announcer and the CUDA
transfers are passed in), wires them to the server's operation table and runs what is nobody's
operation: the reaper of expired leases and the ``stats`` numbers.
"""

from __future__ import annotations

import logging

import trio

from ..._logging import event
from ...config import ServerConfig
from ...protocol import (
    CacheStats,
    Commit,
    EndSession,
    FreeLookupLocks,
    L2Stats,
    Lookup,
    Register,
    Release,
    Retrieve,
    Store,
    Unregister,
)
from .._state import ServerState
from .._tenants import TenantArenas
from ..l2tier import L2Tier
from ._batch import register_lookup_batch
from ._core import CacheCore
from ._cuda import CudaTransfers
from ._io import CacheIO, ChunkNaming
from ._lookups import Lookups
from ._reads import Reads
from ._registrations import Registrations
from ._writes import Writes

__all__ = ["CacheService"]

log = logging.getLogger("kvtrio.cache")

_REAPER_PERIOD = 1.0
"""Longest sleep of the reaper; leases expire at most this late."""


class CacheService:
    """The L1 cache behind the protocol's cache operations. One per server."""

    def __init__(
        self,
        config: ServerConfig,
        arenas: TenantArenas,
        l2: L2Tier,
        cuda: CudaTransfers | None = None,
        announcer: ChunkNaming | None = None,
    ) -> None:
        """``announcer``: the KV events' (``--events``), told of the chunks' names."""
        self.cuda = cuda if cuda is not None else CudaTransfers()
        self.core = core = CacheCore(config, arenas, trio.current_time)
        self.io = io = CacheIO(core, l2, settle_copies=self.cuda.settle, announcer=announcer)
        self.registrations = Registrations(io, self.cuda)
        self.lookups = Lookups(io)
        self.writes = Writes(io)
        self.reads = Reads(io)

    def install(self, state: ServerState) -> None:
        """Register the handlers with the server (lookup runs concurrently)."""
        state.register(Register, self.registrations.register)
        state.register(Unregister, self.registrations.unregister)
        # Inline: answered in the router's round; a Later part (L2, a large scrub) in a task.
        state.register_inline(Lookup, self.lookups.lookup, concurrent=True)
        register_lookup_batch(state, self.lookups.lookup, self.core.budget, self.io.turn)
        state.register_inline(Store, self.writes.store)
        state.register_inline(Commit, self.writes.commit)
        state.register_inline(Retrieve, self.reads.retrieve)  # (waiting for L2 loads: a Later)
        state.register_inline(Release, self.reads.release)
        state.register_inline(FreeLookupLocks, self.lookups.free_lookup_locks)
        state.register_inline(EndSession, self.lookups.end_request)

    # ----------------------------------------------------------------- the reaper

    async def serve_reaper(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Expire leases, free quarantined slots, forget idle requests; never returns.

        Expired write reservations are quarantined (their writer may be slow, not dead).
        Cancellation: between two rounds; a round itself does not checkpoint.
        """
        core = self.core
        task_status.started()
        while True:
            now = trio.current_time()
            expired, when = core.expire(now)
            if expired:
                log.warning(
                    "%d leases expired (clients that neither released nor ended them)",
                    expired,
                    extra=event("leases_expired", count=expired),
                )
            wake = now + _REAPER_PERIOD
            if when is not None:
                wake = min(wake, when)
            await trio.sleep_until(wake)

    # ----------------------------------------------------------------- stats

    def stats(self) -> CacheStats:
        """The cache's part of the ``stats`` reply."""
        core, lookups = self.core, self.lookups
        l1 = core.l1.stats()
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
            leases=core.leases.live,
            leases_expired=core.leases.expired_total,
            registrations=len(core.registry.by_session),
            requests=core.leases.requests,
            lookups=lookups.lookups,
            lookup_hit_chunks=lookups.hit_chunks,
            lookup_miss_chunks=lookups.miss_chunks,
            lookup_l2_chunks=lookups.l2_chunks,
            lookup_timeouts=lookups.timeouts,
            loads_pending=self.io.prefetch.pending_count,
            loads_failed=self.io.prefetch.failed,
            write_behind_queued=self.io.l2.writes.queued,
            write_behind_skipped=self.io.l2.writes.skipped_stores,
            l2_corrupt=self.io.l2.loads.corrupt,
            l2_admitted=self.io.l2.writes.admission.admitted,
            l2_refused=self.io.l2.writes.admission.refused,
            l2_admitted_later=self.io.l2.writes.admission.admitted_later,
        )

    def l2_stats(self) -> tuple[L2Stats, ...]:
        """The L2 backends' part of the ``stats`` reply."""
        return self.io.l2.stats()
