"""The L2 tier in the server: write-behind, lookups across the backend cascade, L2→L1 loads.

- **Write-behind**: a committed chunk is queued (bounded channel) to flusher tasks that frame it
  and store it in every backend (with its L1 parent, to a backend that ``accepts_parents``);
  while queued or being written it is pinned in L1. A full queue
  skips the chunk and counts it: never an unbounded queue.
- **Lookup**: the chunks after the L1 prefix go to every backend's ``lookup_and_lock`` at once;
  the caller runs this inside the lookup's cancel scope, and a cancelled lookup unlocks (shielded)
  whatever it had locked.
- **Loads**: L2 hits get an L1 slot reserved right away and a loader task per batch of a
  request's objects (in the server's loaders nursery, bounded per backend) that reads them into
  their slots with one backend call, verifies their frames in one worker-thread call, and
  unlocks them with one call; each chunk is then committed or dropped on its own. A retrieve
  waits for its chunks' loads; a request's end cancels them.
- **Health**: every exception a backend raises (``BackendError``, any ``OSError``, a plugin's
  ``TypeError``…) is a backend failure: counted, logged (once per outage), and the backend is
  skipped for a growing backoff (0.5 s … 30 s), then tried again; no backend error reaches a
  client, and a failed operation never deletes anything (only an object that loads but fails
  verification, or that the backend reports is not at its size, is deleted). Each backend is probed
  once at start-up (a warning if it fails); its health is unknown until something answered.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence

import attrs
import trio

from .._logging import event
from ..l2 import HEADER_SIZE, Backend, BackendError, Corrupt, check, header
from ..protocol import L2Stats
from ..shm import SharedArena
from ..storage import Entry, L1Cache

__all__ = ["L2Tier", "Load"]

log = logging.getLogger("kvtrio.l2")

_BACKOFF_MIN, _BACKOFF_MAX = 0.5, 30.0
_CPU = trio.CapacityLimiter(2)
"""Checksums of chunks (xxh3, ~7 GB/s) run in worker threads, two at a time."""
_PROBE_TIMEOUT = 10.0
"""Seconds the start-up probe of a backend may take before its health is left unknown."""
_BATCH_CHUNKS = 32
_BATCH_BYTES = 64 << 20
"""A flusher writes at most this many queued chunks (or about this many bytes) per backend call:
one thread hop for the frames and one store per backend for many small chunks."""


@attrs.define(eq=False)
class _Health:
    backend: Backend
    name: str
    label: str = ""
    """The name, made unique within the cascade (``disk``, ``disk#2``): for metrics."""
    down_until: float = -math.inf
    backoff: float = 0.0
    known: bool = False
    """Whether any operation (or the start-up probe) has answered yet."""
    counters: dict[str, int] = attrs.field(factory=dict)

    def count(self, what: str, n: int = 1) -> None:
        self.counters[what] = self.counters.get(what, 0) + n

    def usable(self, now: float) -> bool:
        return now >= self.down_until

    def failed(self, exc: BaseException, now: float) -> None:
        self.known = True
        self.count("errors")
        self.backoff = min(max(self.backoff * 2, _BACKOFF_MIN), _BACKOFF_MAX)
        if self.down_until < now:
            error = _describe(exc)
            log.warning(
                "L2 backend %s failed (%s); skipping it for %.1fs",
                self.name,
                error,
                self.backoff,
                exc_info=None if isinstance(exc, BackendError) else exc,  # a bug: show where
                extra=event(
                    "l2_backend_error", backend=self.label, error=error, backoff_s=self.backoff
                ),
            )
        self.down_until = now + self.backoff

    def succeeded(self) -> None:
        self.known = True
        if self.backoff:
            log.info(
                "L2 backend %s is back",
                self.name,
                extra=event("l2_backend_back", backend=self.label),
            )
        self.backoff = 0.0


@attrs.define(eq=False)
class Load:
    """An L2→L1 load of one object for a request (one of a batch: see ``start_loads``)."""

    key: bytes
    entry: Entry
    source: _Health
    done: trio.Event = attrs.field(factory=trio.Event)
    ok: bool = False
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)


class L2Tier:
    """The backends of one server, in cascade order."""

    def __init__(
        self,
        backends: Sequence[tuple[str, Backend]],
        l1: L1Cache,
        arena: SharedArena,
        *,
        queue_size: int,
        flushers: int,
        loaders: int,
    ) -> None:
        names = [name for name, _ in backends]
        self.backends = [
            _Health(backend, name, name if names.count(name) == 1 else f"{name}#{i + 1}")
            for i, (name, backend) in enumerate(backends)
        ]
        self.observe: Callable[[str, str, float, bool], None] | None = None
        """Set by the metrics: ``(backend label, operation, seconds, succeeded)`` per call."""
        self.l1 = l1
        self.arena = arena
        self._flushers = flushers
        self._send, self._receive = trio.open_memory_channel[tuple[bytes, bytes]](queue_size)
        self._queued = 0
        self._queued_bytes = 0
        self.max_queued_bytes = arena.size // 4
        """Bytes of L1 the queue may pin (a quarter of it): a long queue of large chunks must
        not starve L1 of evictable space."""
        self._limiters = {id(h): trio.CapacityLimiter(loaders) for h in self.backends}
        self._loaders: trio.Nursery | None = None
        self.skipped_stores = 0
        self.corrupt = 0

    @property
    def enabled(self) -> bool:
        return bool(self.backends)

    # ----------------------------------------------------------------- tasks

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the flushers and host the loaders until cancelled; close the backends after.

        Cancellation: running stores and loads are cancelled; closing is shielded and bounded.
        """
        try:
            async with trio.open_nursery() as nursery:
                self._loaders = nursery
                for health in self.backends:
                    nursery.start_soon(self._probe, health)
                for _ in range(self._flushers if self.backends else 0):
                    nursery.start_soon(self._flush, self._receive.clone())
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._loaders = None
            with trio.move_on_after(5) as scope:
                scope.shield = True
                for health in self.backends:
                    try:
                        await health.backend.aclose()
                    except Exception:
                        log.exception("closing L2 backend %s failed", health.name)

    async def _probe(self, health: _Health) -> None:
        """Look up (and unlock) one random key, so that a backend that cannot work (a dead
        service, an L2 path that cannot be created) is reported at start-up, not at the first
        request. A failure is a warning and a backoff; the server serves without it meanwhile.
        Bounded by :data:`_PROBE_TIMEOUT` (health stays unknown if it gets no answer); not
        counted in the request metrics.
        """
        key = os.urandom(32)
        with trio.move_on_after(_PROBE_TIMEOUT):
            try:
                found = await health.backend.lookup_and_lock([key])
            except Exception as exc:  # any failure of a backend: see the module docstring
                health.failed(exc, trio.current_time())
                return
            health.succeeded()
            if found:
                await self._unlock(health, [key])
            log.debug("L2 backend %s answered its start-up probe", health.name)

    # ----------------------------------------------------------------- write-behind

    def write_behind(self, key: bytes, fingerprint: bytes) -> None:
        """Queue a committed L1 chunk for the backends (pinned until written); never waits.
        Skipped (and counted) when the queue is full, in chunks or in bytes."""
        if not self.backends:
            return
        size = self._size(key)
        if self._queued_bytes + size > self.max_queued_bytes:
            self.skipped_stores += 1
            return
        self.l1.pin(key)
        try:
            self._send.send_nowait((key, fingerprint))
        except trio.WouldBlock:
            self.l1.unpin(key)
            self.skipped_stores += 1
            return
        self._queued += 1
        self._queued_bytes += size

    async def _flush(self, receive: trio.MemoryReceiveChannel[tuple[bytes, bytes]]) -> None:
        """Write queued chunks to the backends, a batch at a time, until cancelled.

        A batch is the chunk received plus what is already queued (up to ``_BATCH_CHUNKS``
        chunks or ``_BATCH_BYTES``). Every chunk taken off the queue is unpinned exactly once,
        also when the store fails or the flusher is cancelled.
        """
        async for first in receive:
            batch = [first]
            self._queued -= 1
            try:
                nbytes = self._size(first[0])
                self._queued_bytes -= nbytes
                while len(batch) < _BATCH_CHUNKS and nbytes < _BATCH_BYTES:
                    try:
                        item = receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    batch.append(item)  # (no checkpoint before the finally can see it)
                    self._queued -= 1
                    size = self._size(item[0])
                    self._queued_bytes -= size
                    nbytes += size
                await self._store_batch(batch)
            finally:
                for key, _ in batch:
                    self.l1.unpin(key)

    def _size(self, key: bytes) -> int:
        entry = self.l1.get(key)
        return 0 if entry is None else entry.nbytes

    async def _store_batch(self, batch: Sequence[tuple[bytes, bytes]]) -> None:
        """Frame the (pinned) chunks in one worker thread and store them with one call per
        usable backend; count per key. Cancellation: the running store is cancelled."""
        keys: list[bytes] = []
        parents: list[bytes | None] = []
        fingerprints: list[bytes] = []
        payloads: list[memoryview] = []
        for key, fingerprint in batch:
            entry = self.l1.get(key)
            if entry is None:  # cannot happen while pinned; be safe
                continue
            keys.append(key)
            parents.append(entry.parent)
            fingerprints.append(fingerprint)
            payloads.append(self.arena.memory(entry.offset, entry.nbytes))
        if not keys:
            return
        heads = await trio.to_thread.run_sync(_headers, keys, fingerprints, payloads, limiter=_CPU)
        buffers = [
            [memoryview(head), payload] for head, payload in zip(heads, payloads, strict=True)
        ]
        for health in self.backends:
            if not health.usable(trio.current_time()):
                health.count("stores_skipped", len(keys))
                continue
            started = trio.current_time()
            try:
                if getattr(health.backend, "accepts_parents", False):  # (optional: see Backend)
                    results = await health.backend.store(keys, buffers, parents=parents)  # type: ignore[call-arg]
                else:
                    results = await health.backend.store(keys, buffers)
            except Exception as exc:  # any failure of a backend: see the module docstring
                self._observed(health, "store", started, False)
                health.failed(exc, trio.current_time())
                continue
            self._observed(health, "store", started, True)
            health.succeeded()
            for ok, payload in zip(results, payloads, strict=True):
                health.count("stores" if ok else "stores_refused")
                health.count("store_bytes", payload.nbytes if ok else 0)

    # ----------------------------------------------------------------- lookup

    async def lookup(self, spaces: Sequence[bytes], hashes: Sequence[bytes]) -> list[list[_Health]]:
        """Which backend serves each leading chunk of ``hashes``, for every namespace.

        Returns, per chunk of the found prefix, the backend to load it from (one per space,
        index-aligned with ``spaces``). Objects of the returned chunks are locked in their
        backend; everything else this call locked is unlocked before it returns. If cancelled,
        it unlocks everything it locked (shielded) and raises Cancelled.
        """
        now = trio.current_time()
        usable = [h for h in self.backends if h.usable(now)]
        if not usable or not hashes:
            return []
        keys = [[space + h for h in hashes] for space in spaces]
        locked: dict[tuple[int, int], int] = {}  # (backend index, space index) → locked prefix

        async def probe(b: int, s: int) -> None:
            health = usable[b]
            started = trio.current_time()
            try:
                count = await health.backend.lookup_and_lock(keys[s])
            except Exception as exc:  # any failure of a backend: see the module docstring
                self._observed(health, "lookup_and_lock", started, False)
                health.failed(exc, trio.current_time())
                return
            self._observed(health, "lookup_and_lock", started, True)
            locked[(b, s)] = count  # recorded at once: a cancellation must unlock it
            health.succeeded()

        try:
            async with trio.open_nursery() as nursery:
                for b in range(len(usable)):
                    for s in range(len(spaces)):
                        nursery.start_soon(probe, b, s)
            chosen: list[list[_Health]] = []
            for chunk in range(len(hashes)):
                sources = [
                    next(
                        (usable[b] for b in range(len(usable)) if locked.get((b, s), 0) > chunk),
                        None,
                    )
                    for s in range(len(spaces))
                ]
                if None in sources:
                    break
                chosen.append([h for h in sources if h is not None])
        except BaseException:
            chosen = []
            raise
        finally:
            # Unlock every key locked in a backend it will not be loaded from (all of them when
            # cancelled), shielded so that a cancelled lookup leaves nothing locked.
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                for (b, s), count in locked.items():
                    release = [
                        keys[s][i]
                        for i in range(count)
                        if i >= len(chosen) or chosen[i][s] is not usable[b]
                    ]
                    await self._unlock(usable[b], release)
        return chosen

    async def release(
        self, sources: Sequence[Sequence[_Health]], keys: Sequence[Sequence[bytes]]
    ) -> None:
        """Unlock chunks :meth:`lookup` returned that will not be loaded after all
        (``keys[i][s]`` is locked in ``sources[i][s]``): one ``unlock`` per backend. Shielded
        and bounded."""
        by_backend: dict[int, tuple[_Health, list[bytes]]] = {}
        for chunk_sources, chunk_keys in zip(sources, keys, strict=True):
            for health, key in zip(chunk_sources, chunk_keys, strict=True):
                by_backend.setdefault(id(health), (health, []))[1].append(key)
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            for health, locked in by_backend.values():
                await self._unlock(health, locked)

    async def _unlock(self, health: _Health, keys: list[bytes]) -> None:
        if not keys:
            return
        started = trio.current_time()
        try:
            await health.backend.unlock(keys)
        except Exception as exc:  # any failure of a backend: see the module docstring
            self._observed(health, "unlock", started, False)
            health.failed(exc, trio.current_time())
        else:
            self._observed(health, "unlock", started, True)

    # ----------------------------------------------------------------- loads

    def start_loads(
        self,
        items: Sequence[tuple[bytes, Entry]],
        source: _Health,
        fingerprint: bytes,
        on_done: Callable[[Load], None],
    ) -> list[Load]:
        """Load each ``(key, reserved L1 entry)`` from ``source`` in loader tasks, one batch per
        task: one backend ``load``, one checksum thread hop and one ``unlock`` per batch.

        Batches grow 1, 2, 4, … up to ``_BATCH_CHUNKS`` objects (or about ``_BATCH_BYTES``): the
        first chunk comes back alone, so a partial retrieve can start copying it while the rest
        loads, and a long prefix still costs few calls (100 chunks: 7 batches).

        ``on_done(load)`` runs once per load when its batch ended (ok or not), before
        ``load.done`` is set; the objects stay locked in the backend until then. The loads of a
        batch share one cancel scope (one request's chunks: they are cancelled together).
        """
        assert self._loaders is not None, "the L2 tier is not running"
        loads: list[Load] = []
        batch: list[Load] = []
        nbytes, limit = 0, 1
        for key, entry in items:
            if batch and (len(batch) >= limit or nbytes + entry.nbytes > _BATCH_BYTES):
                self._loaders.start_soon(self._load, batch, fingerprint, on_done)
                batch, nbytes, limit = [], 0, min(2 * limit, _BATCH_CHUNKS)
            scope = batch[0].scope if batch else trio.CancelScope()
            load = Load(key, entry, source, scope=scope)
            batch.append(load)
            loads.append(load)
            nbytes += entry.nbytes
        if batch:
            self._loaders.start_soon(self._load, batch, fingerprint, on_done)
        return loads

    async def _load(
        self, batch: list[Load], fingerprint: bytes, on_done: Callable[[Load], None]
    ) -> None:
        """Read a batch of objects into their L1 slots and verify their frames.

        A backend error fails the whole batch (and deletes nothing); a key the backend answers
        False for, or whose frame fails verification, fails alone and is deleted. Cancellation
        (the batch's scope or the server's): every load ends not ok. Either way every key is
        unlocked exactly once (shielded) and ``on_done`` runs once per load.
        """
        source = batch[0].source
        keys = [load.key for load in batch]
        scope = batch[0].scope
        try:
            with scope:
                async with self._limiters[id(source)]:
                    heads = [bytearray(HEADER_SIZE) for _ in batch]
                    payloads = [self.arena.memory(ld.entry.offset, ld.entry.nbytes) for ld in batch]
                    buffers = [
                        [memoryview(head), payload]
                        for head, payload in zip(heads, payloads, strict=True)
                    ]
                    started = trio.current_time()
                    answered = False  # (an error proves nothing about the objects: they stay)
                    try:
                        results = await source.backend.load(keys, buffers)
                        if len(results) != len(keys):
                            raise BackendError(
                                f"load answered {len(results)} results for {len(keys)} keys"
                            )
                    except Exception as exc:  # any failure of a backend: see the module docstring
                        self._observed(source, "load", started, False)
                        source.failed(exc, trio.current_time())
                        oks = [False] * len(batch)
                    else:
                        self._observed(source, "load", started, True)
                        answered = True
                        oks = [bool(ok) for ok in results]
                    doomed: list[bytes] = []
                    read = [i for i, ok in enumerate(oks) if ok]
                    if read:
                        verdicts = await trio.to_thread.run_sync(
                            _check_all,
                            [bytes(heads[i]) for i in read],
                            [keys[i] for i in read],
                            fingerprint,
                            [payloads[i] for i in read],
                            limiter=_CPU,
                        )
                        for i, error in zip(read, verdicts, strict=True):
                            if error is None:
                                continue
                            oks[i] = False
                            self.corrupt += 1
                            source.count("corrupt")
                            log.warning(
                                "L2 backend %s: corrupt object deleted (%s)",
                                source.name,
                                error,
                                extra=event("l2_corrupt", backend=source.label, error=str(error)),
                            )
                            doomed.append(keys[i])
                    if answered and not scope.cancel_called:
                        # The backend answered that these were there (locked) yet not at their
                        # size: truncated, or evicted behind the lock's back. Of no use any more.
                        # (A failed read, by contrast, proves nothing: those objects stay.)
                        unreadable = [keys[i] for i, ok in enumerate(results) if not ok]
                        source.count("unreadable", len(unreadable))
                        doomed += unreadable
                    if doomed:
                        await self._delete(source, doomed)
                    for load, ok in zip(batch, oks, strict=True):
                        load.ok = ok
                        source.count("loads" if ok else "load_misses")
                        source.count("load_bytes", load.entry.nbytes if ok else 0)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self._unlock(source, keys)
            for load in batch:
                on_done(load)
                load.done.set()

    async def _delete(self, health: _Health, keys: list[bytes]) -> None:
        started = trio.current_time()
        try:
            await health.backend.delete(keys)
        except Exception as exc:  # any failure of a backend: see the module docstring
            self._observed(health, "delete", started, False)
            health.failed(exc, trio.current_time())
        else:
            self._observed(health, "delete", started, True)

    def _observed(self, health: _Health, op: str, started: float, ok: bool) -> None:
        if self.observe is not None:
            self.observe(health.label, op, trio.current_time() - started, ok)

    # ----------------------------------------------------------------- stats

    def stats(self) -> tuple[L2Stats, ...]:
        now = trio.current_time()
        result = []
        for health in self.backends:
            try:
                own = dict(health.backend.statistics())
            except Exception:  # a plugin's statistics must not break stats
                own = {}
            result.append(
                L2Stats(
                    name=health.label,
                    healthy=health.usable(now) if health.known else None,
                    counters={k: float(v) for k, v in {**own, **health.counters}.items()},
                )
            )
        return tuple(result)

    @property
    def queued(self) -> int:
        return self._queued


def _describe(exc: BaseException) -> str:
    """One line for a backend failure: the message, with the type unless it is ours."""
    if isinstance(exc, BackendError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"


def _headers(
    keys: Sequence[bytes], fingerprints: Sequence[bytes], payloads: Sequence[memoryview]
) -> list[bytes]:
    """The frame headers of a batch of chunks (in a worker thread)."""
    return [header(k, f, p) for k, f, p in zip(keys, fingerprints, payloads, strict=True)]


def _check_all(
    heads: Sequence[bytes],
    keys: Sequence[bytes],
    fingerprint: bytes,
    payloads: Sequence[memoryview],
) -> list[Corrupt | None]:
    """Verify the frames of a batch of loaded objects (in a worker thread): per object, None or
    what does not match."""
    verdicts: list[Corrupt | None] = []
    for head, key, payload in zip(heads, keys, payloads, strict=True):
        try:
            check(head, key, fingerprint, payload)
        except Corrupt as exc:
            verdicts.append(exc)
        else:
            verdicts.append(None)
    return verdicts
