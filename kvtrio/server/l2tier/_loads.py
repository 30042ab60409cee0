"""Lookups across the backend cascade and L2 → L1 loads.

- **Lookup**: the chunks after the L1 prefix go to every backend's ``lookup_and_lock``, one
  call per namespace (rank), at most :data:`RANKS_AT_ONCE` at once per backend; the caller runs this
  inside the lookup's cancel scope, and a cancelled lookup unlocks (shielded) whatever it had
  locked.
- **Loads**: L2 hits get an L1 slot reserved right away (by the caller) and a loader task per
  batch of a request's objects (in the tier's loaders nursery, bounded per backend) that reads
  them into their slots with one backend call, verifies their frames in one worker-thread call,
  and unlocks them with one call; each chunk is then committed or dropped on its own. A failed
  operation never deletes anything: only an object that loads but fails verification, or that
  the backend reports is not at its size, is deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import attrs
import trio

from ..._logging import event
from ...l2 import HEADER_SIZE, BackendError, Corrupt, UnreadableObjects, check
from ...shm import SharedArena
from ...storage import Entry
from ._backends import Calls, TierBackend
from ._writes import CPU_THREADS

__all__ = ["RANKS_AT_ONCE", "Load", "Loads"]

log = logging.getLogger("kvtrio.l2")

RANKS_AT_ONCE = 4
"""Concurrent ``lookup_and_lock`` calls of one lookup per backend: a lookup asks one key list
per rank, and a world of 256 ranks must not make 256 runnable tasks at once (issue 22)."""
_BATCH_CHUNKS = 32
_BATCH_BYTES = 64 << 20
"""A load batch holds at most this many objects (or about this many bytes), as the
write-behind's store batches."""


@attrs.define(eq=False)
class Load:
    """An L2→L1 load of one object for a request (one of a batch: see ``start_loads``)."""

    key: bytes
    entry: Entry
    source: TierBackend
    done: trio.Event = attrs.field(factory=trio.Event)
    ok: bool = False
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)


class Loads:
    """Lookups and loads of one tier (their loader tasks run in the tier's nursery)."""

    def __init__(
        self,
        backends: Sequence[TierBackend],
        arena: SharedArena,
        calls: Calls,
        tasks: trio.Nursery,
        *,
        loaders: int,
        cpu: trio.CapacityLimiter | None = None,
    ) -> None:
        """``tasks``: the tier's nursery, where loader tasks run; ``cpu``: the tier's limiter of
        checksum threads (shared with its write-behind)."""
        self.backends = backends
        self._cpu = cpu if cpu is not None else trio.CapacityLimiter(CPU_THREADS)
        self.arena = arena
        self._calls = calls
        self._limiters = {id(b): trio.CapacityLimiter(loaders) for b in backends}
        self._loaders = tasks
        self.corrupt = 0

    # ----------------------------------------------------------------- lookup

    async def lookup(
        self, spaces: Sequence[bytes], hashes: Sequence[bytes]
    ) -> list[list[TierBackend]]:
        """Which backend serves each leading chunk of ``hashes``, for every namespace.

        Returns, per chunk of the found prefix, the backend to load it from (one per space,
        index-aligned with ``spaces``). Objects of the returned chunks are locked in their
        backend; everything else this call locked is unlocked before it returns. If cancelled,
        it unlocks everything it locked (shielded) and raises Cancelled.
        """
        now = trio.current_time()
        usable = [b for b in self.backends if b.usable(now)]
        if not usable or not hashes:
            return []
        keys = [[space + h for h in hashes] for space in spaces]
        locked: dict[tuple[int, int], int] = {}  # (backend index, space index) → locked prefix

        async def ask(b: int, s: int) -> None:
            tier_backend = usable[b]
            with self._calls.call(tier_backend, "lookup_and_lock", heals=True):
                # (recorded at once: a cancellation must unlock it)
                locked[(b, s)] = await tier_backend.backend.lookup_and_lock(keys[s])

        async def asker(b: int, left: Iterator[int]) -> None:
            for s in left:  # (the iterator is shared by the backend's askers)
                await ask(b, s)

        try:
            async with trio.open_nursery() as nursery:
                for b in range(len(usable)):
                    left = iter(range(len(spaces)))
                    for _ in range(min(RANKS_AT_ONCE, len(spaces))):
                        nursery.start_soon(asker, b, left)
            listener = self._calls.listener
            if listener is not None:
                for (b, s), count in locked.items():
                    listener.seen(keys[s], count, usable[b].label)
            chosen: list[list[TierBackend]] = []
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
                chosen.append([b for b in sources if b is not None])
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
                    await self._calls.unlock(usable[b], release)
        return chosen

    async def release(
        self, sources: Sequence[Sequence[TierBackend]], keys: Sequence[Sequence[bytes]]
    ) -> None:
        """Unlock chunks :meth:`lookup` returned that will not be loaded after all
        (``keys[i][s]`` is locked in ``sources[i][s]``): one ``unlock`` per backend. Shielded
        and bounded."""
        by_backend: dict[int, tuple[TierBackend, list[bytes]]] = {}
        for chunk_sources, chunk_keys in zip(sources, keys, strict=True):
            for source, key in zip(chunk_sources, chunk_keys, strict=True):
                by_backend.setdefault(id(source), (source, []))[1].append(key)
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            for source, locked in by_backend.values():
                await self._calls.unlock(source, locked)

    # ----------------------------------------------------------------- loads

    def start_loads(
        self,
        items: Sequence[tuple[bytes, Entry]],
        source: TierBackend,
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
        False for, or whose frame fails verification, fails alone and is deleted; a key the
        backend could not read (:class:`UnreadableObjects`) fails alone and is deleted at its
        second such failure (see ``TierBackend.unreadable``). Cancellation
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
                    partial: UnreadableObjects | None = None  # (some objects' own errors)
                    with self._calls.call(source, "load") as call:
                        try:
                            results = await source.backend.load(keys, buffers)
                        except UnreadableObjects as exc:  # the others were read
                            results, partial = exc.results, exc
                            call.complete = False
                        if len(results) != len(keys):
                            raise BackendError(
                                f"load answered {len(results)} results for {len(keys)} keys"
                            )
                    answered = not call.failed  # (an error proves nothing about the objects)
                    oks = [False] * len(batch)
                    failed: set[bytes] = set()  # (the objects of a partial answer)
                    if answered:
                        failed = set() if partial is None else set(partial.unreadable)
                        oks = [
                            bool(ok) and key not in failed
                            for ok, key in zip(results, keys, strict=True)
                        ]
                    read_keys = [key for key, ok in zip(keys, oks, strict=True) if ok]  # (whole)
                    doomed: list[bytes] = []
                    read = [i for i, ok in enumerate(oks) if ok]
                    if read:
                        verdicts = await trio.to_thread.run_sync(
                            _check_all,
                            [bytes(heads[i]) for i in read],
                            [keys[i] for i in read],
                            fingerprint,
                            [payloads[i] for i in read],
                            limiter=self._cpu,
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
                        # (A failed call, by contrast, proves nothing: those objects stay; one
                        # the backend names unreadable goes at its second failure in a row.)
                        unreadable = [
                            k
                            for k, ok in zip(keys, results, strict=True)
                            if not ok and k not in failed
                        ]
                        if read_keys:
                            source.read_some(read_keys)
                        if partial is not None:  # twice unreadable: gone (see _backends)
                            lost = [key for key in keys if key in failed]
                            now = trio.current_time()
                            others = bool(read_keys)
                            dropped = source.unreadable(lost, partial, now, read_others=others)
                            if dropped:
                                log.warning(
                                    "L2 backend %s: %d object(s) unreadable twice, deleted (%s)",
                                    source.name,
                                    len(dropped),
                                    partial,
                                    extra=event(
                                        "l2_unreadable", backend=source.label, error=str(partial)
                                    ),
                                )
                            unreadable += dropped
                        source.count("unreadable", len(unreadable))
                        doomed += unreadable
                    if doomed:
                        await self._calls.delete(source, doomed)
                    for load, ok in zip(batch, oks, strict=True):
                        load.ok = ok
                        source.count("loads" if ok else "load_misses")
                        source.count("load_bytes", load.entry.nbytes if ok else 0)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self._calls.unlock(source, keys)
            for load in batch:
                on_done(load)
                load.done.set()


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
