"""The L2 tier of one server: its backends in cascade order, its tasks, its stats.

The work is in the parts, which the cache uses directly: write-behind (:attr:`L2Tier.writes`,
:mod:`._writes`), lookups and loads (:attr:`L2Tier.loads`, :mod:`._loads`), L1 hits passed on to
the backends' eviction policies (:attr:`L2Tier.touches`, :mod:`._touches`); the backends' health
and the one boundary for calls into them are in :mod:`._backends`. Each backend's health is
checked at start-up, before the server serves (a lookup, which builds a disk L2's index; a
warning if it fails), and again while it has a problem (a lookup, and a store where stores
failed); its health is unknown until something answered, false while lookups or stores fail. A
backend whose start-up health check finds it misconfigured
(:class:`~kvtrio.l2.BackendMisconfigured`: a Redis Cluster node without ``cluster=true``) stops
the start with that one line (:class:`ConfigError`). The
fleet records (:attr:`L2Tier.fleet`, :mod:`._fleet`) tell servers sharing a backend that they
name a model's chunks differently.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from ...errors import ConfigError
from ...l2 import Backend
from ...protocol import L2Stats
from ...shm import SharedArena
from ...storage import L1Cache
from ._backends import Calls, Observe, TierBackend, TierListener
from ._fleet import Fleet
from ._loads import Loads
from ._touches import Touches
from ._writes import CPU_THREADS, WriteBehind

__all__ = ["L2Tier", "open_l2_tier"]

log = logging.getLogger("kvtrio.l2")

_CHECK_TIMEOUT = 10.0
"""Seconds the start-up health check of a backend may take before its health is left unknown."""
_RECHECK_INTERVAL = 1.0
"""Seconds between checks whether a backend with a problem is due for another health check."""
_CHECK_OBJECT = b"kvtrio health probe"
_RECALL_SLICE = 1000
"""Chunks a recall of names announces at once (:meth:`L2Tier.recall`): a batch of events."""
_RECALL_PAUSE = 0.01
"""Seconds between two slices of a recall (more than a batch's gathering, 5 ms by default)."""


@asynccontextmanager
async def open_l2_tier(
    backends: Sequence[tuple[str, Backend]], l1: L1Cache, arena: SharedArena, **options: Any
) -> AsyncIterator[L2Tier]:
    """The L2 tier over ``backends`` (``options``: :class:`L2Tier`'s), its tasks' nursery open
    for the block; :meth:`L2Tier.start` checks the backends' health and starts the tasks.
    Leaving the block cancels the tasks (stores and loads under way), then closes the backends
    (shielded, at most 5 s), also if the tier could not be made."""
    try:
        async with trio.open_nursery() as tasks:
            tier = L2Tier(backends, l1, arena, tasks, **options)
            try:
                yield tier
            finally:
                tasks.cancel_scope.cancel()
    finally:
        with trio.move_on_after(5) as scope:
            scope.shield = True
            for name, backend in backends:
                try:
                    await backend.aclose()
                except Exception:
                    log.exception("closing L2 backend %s failed", name)


class L2Tier:
    """The backends of one server, in cascade order (made by :func:`open_l2_tier`)."""

    def __init__(
        self,
        backends: Sequence[tuple[str, Backend]],
        l1: L1Cache,
        arena: SharedArena,
        tasks: trio.Nursery,
        *,
        queue_size: int,
        flushers: int,
        loaders: int,
        observe: Observe | None = None,
        tenants: Callable[[], int] = lambda: 1,
        listener: TierListener | None = None,
        chunk_size: int = 256,
        instance: str = "",
        write_through: bool = False,
        admission: str = "all",
        recalls: trio.MemoryReceiveChannel[tuple[bytes, int]] | None = None,
    ) -> None:
        """``observe`` is told of every backend call (the metrics'; see :data:`Observe`);
        ``tenants`` says how many tenants the server serves (their fair shares of the
        write-behind queue); ``chunk_size`` and ``instance`` (the server's) go into the fleet
        records; ``write_through``: a store's commit waits for its chunks' L2 writes;
        ``admission``: which committed chunks are written (``all``, ``reuse``, or ``auto``:
        ``reuse`` unless a backend is a shared store; see ``_admission``); ``tasks``: the
        nursery the tier's tasks run in (loaders, fleet checks, flushers); ``recalls``: the
        requests of :meth:`recall` (``(namespace, limit)``, from the KV events' announcer, made
        before the tier), served once the tier has started."""
        self._recall_requests = recalls
        names = [name for name, _ in backends]
        self.backends = [
            TierBackend(backend, name, name if names.count(name) == 1 else f"{name}#{i + 1}")
            for i, (name, backend) in enumerate(backends)
        ]
        if admission == "auto":
            shared = any(b.capabilities.shared for b in self.backends)
            admission = "all" if shared else "reuse"
        self._calls = Calls(observe, listener)
        cpu = trio.CapacityLimiter(CPU_THREADS)  # checksum threads, stores and loads together
        self.writes = WriteBehind(
            self.backends,
            l1,
            arena,
            self._calls,
            queue_size=queue_size,
            flushers=flushers,
            tenants=tenants,
            write_through=write_through,
            admission=admission,
            cpu=cpu,
        )
        """Committed chunks on their way to the backends."""
        self._tasks = tasks
        self.loads = Loads(self.backends, arena, self._calls, tasks, loaders=loaders, cpu=cpu)
        """Lookups across the cascade and L2 → L1 loads."""
        self.touches = Touches(self.backends, self._calls)
        """L1 hits on their way to the backends that take touches."""
        self.recalls = 0
        """Recalls of names (:meth:`recall`) that ended."""
        self.fleet = Fleet(
            self.backends, self._calls, tasks, chunk_size=chunk_size, instance=instance
        )
        """The models' fleet records in the backends."""

    @property
    def enabled(self) -> bool:
        return bool(self.backends)

    # ----------------------------------------------------------------- names

    def recall(self, space: bytes, limit: int) -> None:
        """Read back the names kept beside namespace ``space``'s chunks (at most ``limit``
        bytes from each backend that keeps names: the newest chunks') and hand them to the
        listener (the KV events' announcer) in slices, oldest first. Never waits: a task in the
        tier's nursery does it (:attr:`recalls` counts those that ended)."""
        if self._calls.listener is not None and any(b.capabilities.names for b in self.backends):
            self._tasks.start_soon(self._recall, space, limit)
        else:
            self.recalls += 1

    async def _recall(self, space: bytes, limit: int) -> None:
        """:meth:`recall`'s task. A backend's failure is its own (counted, backed off); the
        slices of :data:`_RECALL_SLICE` chunks are :data:`_RECALL_PAUSE` apart, so that a
        tenant's whole budget of names leaves in batches of bounded size. Cancellation: the
        slices not yet handed over are dropped."""
        listener = self._calls.listener
        assert listener is not None
        for tier_backend in self.backends:
            if not tier_backend.capabilities.names:
                continue
            with self._calls.call(tier_backend, "names", metered=False) as call:
                found = await tier_backend.names(space, limit)
            if call.failed:
                continue
            tier_backend.count("names_recalled", len(found))
            oldest_first = list(reversed(found))
            for start in range(0, len(oldest_first), _RECALL_SLICE):
                if start:
                    await trio.sleep(_RECALL_PAUSE)
                for key, record in oldest_first[start : start + _RECALL_SLICE]:
                    listener.recovered(key, tier_backend.label, record)
        self.recalls += 1

    # ----------------------------------------------------------------- tasks

    async def start(self) -> None:
        """Check every backend's health (at once, each for at most :data:`_CHECK_TIMEOUT`), then
        start the flushers, the rechecks and the touches' task in the tier's nursery, and
        return. The server serves only once this returned, so the first lookup after a restart
        sees the L2 as it is (a disk L2 has built its index).

        A backend found misconfigured by its start-up health check raises :class:`ConfigError`
        (the server does not start). Cancellation: the checks are cancelled, nothing is started.
        """
        async with trio.open_nursery() as checks:
            for tier_backend in self.backends:
                checks.start_soon(self._check_at_start, tier_backend)
        for tier_backend in self.backends:
            self._tasks.start_soon(self._recheck, tier_backend)
        self.writes.start(self._tasks)
        self._tasks.start_soon(self.touches.run)
        if self._recall_requests is not None:
            self._tasks.start_soon(self._serve_recalls, self._recall_requests)

    async def _serve_recalls(self, requests: trio.MemoryReceiveChannel[tuple[bytes, int]]) -> None:
        """Start a :meth:`recall` for each request, until cancelled (with the tier's tasks)."""
        async for space, limit in requests:
            self.recall(space, limit)

    async def _recheck(self, tier_backend: TierBackend) -> None:
        """After the start-up health check (:meth:`serve`), check ``tier_backend`` again whenever it
        has a problem and its backoff has passed, until cancelled: so that a backend that cannot
        work (a dead service, an L2 path that cannot be created) is reported at start-up, not at
        the first request, and reads healthy again as soon as it works, also when no traffic
        would have tried it.

        Cancellation: a check under way is abandoned (see :meth:`_check_once`).
        """
        while True:
            wait = max(tier_backend.down_until - trio.current_time(), _RECHECK_INTERVAL)
            await trio.sleep(wait)
            if tier_backend.problems:
                await self._check_once(tier_backend)

    async def _check_at_start(self, tier_backend: TierBackend) -> None:
        """The start-up health check (:meth:`_check_once`): :class:`ConfigError` where it found the
        backend misconfigured (the reason, with the option to set, in one line)."""
        await self._check_once(tier_backend)
        problem = tier_backend.misconfigured
        if problem:
            raise ConfigError(f"L2 backend {tier_backend.label}: {problem}")

    async def _check_once(self, tier_backend: TierBackend) -> None:
        """Look up (and unlock) one random key; where stores have been failing, also store an
        object under another random key and delete it. A failure is a warning, a backoff and
        a problem (unhealthy, with the reason); the server serves without the backend
        meanwhile. Bounded by :data:`_CHECK_TIMEOUT` (health stays as it was if no answer
        came); not counted in the request metrics.

        A healthy backend is never written to by a health check (no object, no segment space at each
        start): a disk that answers lookups but cannot write shows as unhealthy from its
        first failed store on. The check's object is not a kvtrio frame: nothing loads it.
        Cancellation: the check is abandoned (its object may stay, unreachable).
        """
        with trio.move_on_after(_CHECK_TIMEOUT):
            key = os.urandom(32)
            check = self._calls.call(tier_backend, "lookup_and_lock", heals=True, metered=False)
            with check as call:
                found = await tier_backend.backend.lookup_and_lock([key])
            if call.failed:
                return
            if found:
                await self._calls.unlock(tier_backend, [key])
            if "store" in tier_backend.problems:
                await self._check_store(tier_backend)
            log.debug("L2 backend %s answered its health check", tier_backend.name)

    async def _check_store(self, tier_backend: TierBackend) -> None:
        """Store one health-check object and delete it (see :meth:`_check_once`)."""
        key, buffers = os.urandom(32), [[memoryview(_CHECK_OBJECT)]]
        check = self._calls.call(tier_backend, "store", "store", heals=True, metered=False)
        with check as call:
            stored = await tier_backend.store([key], buffers, parents=[None])
        if call.failed:
            return
        if stored and stored[0]:
            await self._calls.delete(tier_backend, [key])

    # ----------------------------------------------------------------- stats

    def stats(self) -> tuple[L2Stats, ...]:
        result = []
        for tier_backend in self.backends:
            try:  # a plugin's statistics must not break stats
                own = {k: float(v) for k, v in dict(tier_backend.backend.statistics()).items()}
            except Exception:
                own = {}
            result.append(
                L2Stats(
                    name=tier_backend.label,
                    healthy=tier_backend.healthy,
                    problem=tier_backend.problem,
                    counters={k: float(v) for k, v in {**own, **tier_backend.counters}.items()},
                )
            )
        return tuple(result)
