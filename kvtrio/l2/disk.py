"""``disk``: objects in segment files on a local filesystem, the default L2 of ``kvtrio serve``.

Objects are appended to segment files (``segments/*.seg``, ``segment_size`` each; records,
punched holes, unlinks: see :mod:`._diskio`), a batch with one ``pwritev``, visible (indexed)
once written whole, optionally ``fdatasync``ed. The index (key → segment, offset, length) is
rebuilt by scanning the segments (oldest first) before the server serves (the L2 tier's
start-up probe), so a restarted server serves what it stored from its first lookup; files that
are not segments are ignored and reported once. Record headers are authenticated with the L2's
secret: the scan never takes a client's bytes for a record.

Eviction order is a :class:`kvtrio.storage.EvictionPolicy` (option ``eviction``) per owner over
its unlocked objects, O(1) amortised per store; ``store`` takes parents (``accepts_parents``: a
prompt's tail goes first; scanned objects have none) and owners (``accepts_owners``: room is
made by evicting from the tenant holding the most, :mod:`._diskspace`); ``touch`` takes hits
served from the server's L1 (``accepts_touches``).

A record is never freed while a load is reading it (replaced, deleted or evicted meanwhile: the
hole is punched when the read ends), so a load returns the object it looked up, whole. A read
error fails its own records only (``UnreadableObjects``): the server decides what to drop.

Capacity counts bytes as they lie on disk (headers and alignment included) and is the smaller
of the option and what the filesystem can hold (our bytes plus its free space, minus a 2%
reserve), re-measured after every written batch: a full filesystem (``ENOSPC``) lowers it,
evicts down to it, and refuses the rest of the batch instead of failing for good. A filesystem
that reports no size (ramfs) is bounded by the option alone.
Filesystem errors are BackendError (misconfigured if they never go away: ``open_tree``); failed
punches and unlinks are counted. Blocking file I/O runs in worker threads, ``threads`` at once.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import trio

from ..storage import make_policy
from ._diskio import (
    OWNER_SIZE,
    Written,
    filesystem_space,
    free_ranges,
    read_names,
    read_records,
    reason,
    record_size,
    segment_name,
    write_records,
)
from ._disklock import DirectoryLock
from ._diskoptions import DiskOptions
from ._diskscan import open_tree, report_scan
from ._diskspace import PolicyFactory, Room
from ._interface import BackendError, Buffers, UnreadableObjects
from ._locks import LocalLocks
from ._segments import Location, Segments

__all__ = ["DiskBackend", "DiskOptions"]

log = logging.getLogger("kvtrio.l2.disk")


class DiskBackend:
    name = "disk"
    Options = DiskOptions
    accepts_parents = True
    """``store`` takes ``parents=``: the eviction policy knows each object's prompt prefix."""
    accepts_owners = True
    """``store`` takes ``owners=``: tenant tags, for the tenants' shares of the capacity."""
    accepts_touches = True
    """``touch``: hits served from the server's L1 refresh the eviction policy."""
    accepts_names = True
    """``store`` takes ``names=``, kept in each record's padding; ``names`` reads them back."""

    def __init__(
        self, options: DiskOptions | None = None, *, policies: PolicyFactory | None = None
    ) -> None:
        """``policies`` makes each owner's eviction policy (default: ``eviction``'s)."""
        self.options = options or DiskOptions()
        if self.options.threads < 1:
            raise ValueError("threads must be at least 1")
        if int(self.options.segment_size) < 1:
            raise ValueError("segment_size must be positive")
        self.root = Path(os.path.expanduser(self.options.path))
        self._segments_dir = self.root / "segments"
        self._prefix = f"{self._segments_dir}/"
        self._io = trio.CapacityLimiter(self.options.threads)  # the "disk I/O" limiter
        self._index: dict[bytes, Location] = {}  # every object on disk
        make_policy(self.options.eviction)  # (ValueError naming the known ones if unknown)
        factory = policies or (lambda: make_policy(self.options.eviction))
        self._room = Room(factory, self.options.tenant_share, int(self.options.capacity))
        self._locks = LocalLocks()
        self._lock = DirectoryLock(self.root)  # the directory's: taken by the first scan
        self._space = Segments(int(self.options.segment_size))
        self._secret = b""  # the record headers' MAC key: read (or made) by the scan
        self._measured_at = -math.inf
        self._indexed = False
        self._indexing: trio.Event | None = None
        self._punch_warned = False
        self.counters = collections.Counter[str]()

    # ----------------------------------------------------------------- the index

    def _path(self, segment: int) -> str:
        return f"{self._prefix}{segment_name(segment)}"

    async def _ensure_index(self) -> None:
        """Create, lock and scan the directory once (concurrent callers wait for the one scan
        and share its failure; the next call after a failure scans again). Raises
        BackendError (one line: see ``open_tree``). Cancellation: the scan thread runs to its
        end, unused.

        One scan at a time: was, after a failed scan, a scan per waiting caller at once, racing
        for the directory lock (one of them refused as "in use by another kvtrio server")."""
        if self._indexed:
            return
        if self._indexing is not None:
            await self._indexing.wait()
            if self._is_indexed():
                return
            raise BackendError(f"disk: {self.root}: its scan failed; tried again at the next call")
        self._indexing = scanning = trio.Event()
        try:
            found = await trio.to_thread.run_sync(
                open_tree, self.root, self._segments_dir, self._lock, limiter=self._io
            )
        finally:
            self._indexing = None  # (the next call after a failure scans again)
            scanning.set()
        self._secret = found.secret
        for segment, records in found.segments:
            self._space.scanned(segment, len(records))
            for key, offset, length, owner in records:
                if key in self._index:  # stored again later: the older record goes
                    self._space.release(self._forget(key))
                self._index[key] = (segment, offset, length)
                self._room.indexed(key, owner, record_size(length))
                self._room.add(key)
        self._indexed = True
        self._measured(found.free, found.total)
        report_scan(found, self.root, self.counters)
        await self._free()

    def _is_indexed(self) -> bool:
        return self._indexed

    def _visible(self, key: bytes) -> bool:
        return key in self._index and not self._locks.is_doomed(key)

    def _measured(self, free: int, total: int) -> None:
        """Set the capacity from the filesystem's free space (see :meth:`Room.measured`);
        log when the filesystem starts to bound it (once, not at every batch)."""
        message = self._room.measured(free, total, int(self.options.capacity))
        if message is not None:
            level = logging.WARNING if total <= 0 else logging.INFO
            log.log(level, "disk L2 %s: %s", self.root, message)

    # ----------------------------------------------------------------- the interface

    async def lookup_and_lock(self, keys: Sequence[bytes]) -> int:
        await self._ensure_index()
        await trio.lowlevel.checkpoint()
        found = 0
        for key in keys:
            if not self._visible(key):
                break
            found += 1
        for key in reversed(keys[:found]):  # a hit (last chunk first: the head ends newest)
            self._room.touch(key)
        for key in keys[:found]:
            self._room.hold(key)  # locked: not evictable until its last unlock
        self._locks.lock(keys[:found])
        return found

    async def unlock(self, keys: Sequence[bytes]) -> None:
        """Drop one lock per key, first thing (a cancellation cannot skip it); free the records
        of objects deleted while locked (shielded)."""
        was_locked = [key for key in keys if self._locks.is_locked(key)]
        gone = self._locks.unlock(keys)
        for key in was_locked:
            if key in self._index and not self._locks.is_locked(key):
                self._room.add(key)
        for key in gone:
            if key in self._index:
                self._space.release(self._forget(key))
        if not await self._free():
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        """Read the objects in one worker-thread call (one ``preadv`` per run of adjacent
        records, kept allocated meanwhile); per key False if not there or not at the buffers'
        size. A read error fails its own records: UnreadableObjects names them; an error opening
        a segment fails the call. Cancellation: the thread runs to its end, results unused."""
        await self._ensure_index()
        results = [False] * len(keys)
        wanted: list[tuple[int, Location]] = []
        for i, (key, parts) in enumerate(zip(keys, buffers, strict=True)):
            location = self._index.get(key)  # (a deleted but locked object still loads)
            if location is not None and location[2] == sum(len(p) for p in parts):
                wanted.append((i, location))
                self._space.start_reading(location)
        if not wanted:
            await trio.lowlevel.checkpoint()
            return results
        try:
            outcomes = await trio.to_thread.run_sync(
                read_records,
                [(self._path(s), o, keys[i], buffers[i]) for i, (s, o, _) in wanted],
                self._secret,
                limiter=self._io,
            )
        except OSError as exc:
            self.counters["errors"] += 1
            raise BackendError(f"disk: reading an object failed: {reason(exc)}") from None
        finally:
            for _, location in wanted:
                self._space.done_reading(location)
            await self._free()
        failed: dict[bytes, OSError] = {}  # (their objects stay: the server decides)
        for (i, location), ok in zip(wanted, outcomes, strict=True):
            if isinstance(ok, OSError):
                failed[keys[i]] = ok
            elif ok is None and self._index.get(keys[i]) == location:  # segment removed
                self._space.release(self._forget(keys[i]))  # (an unlink of nothing: harmless)
            elif ok:
                self._room.touch(keys[i])
            results[i] = ok is True
            self.counters["loads"] += 1
            self.counters["load_bytes"] += location[2] if ok is True else 0
        if failed:
            self.counters["read_errors"] += len(failed)
            error = f"{len(failed)} object(s) failed: {reason(next(iter(failed.values())))}"
            raise UnreadableObjects(f"disk: reading {error}", results, list(failed))
        return results

    async def touch(self, keys: Sequence[bytes]) -> None:
        """Count uses (from L1) as policy hits, last key last; cancelled: nothing touched."""
        await trio.lowlevel.checkpoint()
        for key in keys:
            self._room.touch(key)

    async def store(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Buffers],
        *,
        parents: Sequence[bytes | None] | None = None,
        owners: Sequence[bytes] | None = None,
        names: Sequence[bytes | None] | None = None,
    ) -> list[bool]:
        """Reserve room for each object in order, then append the batch to the active segment
        in one worker-thread call.

        ``parents`` (optional, index-aligned) names the object before each one in its prompt,
        for the eviction policy: a prompt leaves tail first, and objects after an evicted one
        (unreachable by a prefix lookup) go first. ``owners`` (optional, index-aligned, at most
        16 bytes each) names each object's tenant: room is made by evicting from the tenant that
        holds the most (see :mod:`._diskspace`). ``names`` (optional, index-aligned): what each
        object is named by, kept in its record's padding where they fit (:mod:`._diskrecord`).

        Objects written before a failing one are stored (and visible); the failing one and the
        rest are not (their ranges are punched out). A full filesystem lowers the capacity and
        evicts down to it (the rest of the batch is refused, not an error); any other failure
        raises BackendError. Cancellation: the write thread runs to its end (an object is
        indexed only once written whole); reservations not turned into objects are released.
        """
        await self._ensure_index()
        await self._remeasure()
        if any(not 0 < len(key) <= 32 for key in keys):
            raise ValueError("disk: keys are 1 to 32 bytes")
        if owners is not None and any(len(owner) > OWNER_SIZE for owner in owners):
            raise ValueError(f"disk: owners are at most {OWNER_SIZE} bytes")
        results = [False] * len(keys)
        todo: list[tuple[int, bytes, bytes, Buffers, Location]] = []  # index, key, owner, …
        named = names or [None] * len(keys)
        outcome = Written(0, None, None)
        try:
            # Room and ranges for the whole batch with no checkpoint in between (so the batch
            # is contiguous), then one thread call frees what was evicted, one writes.
            for i, (key, parts) in enumerate(zip(keys, buffers, strict=True)):
                owner = b"" if owners is None else owners[i]
                length = sum(len(p) for p in parts)
                if not self._make_room(record_size(length), owner):
                    self.counters["store_refused"] += 1
                    continue
                # Reserved now, so concurrent stores do not overshoot.
                self._room.reserve(owner, record_size(length))
                todo.append((i, key, owner, parts, self._space.allocate(length)))
            await self._free()
            if not todo:
                return results
            outcome = await trio.to_thread.run_sync(
                write_records,
                [(self._path(s), o, k, w, p, named[i]) for i, k, w, p, (s, o, _) in todo],
                self.options.fsync,
                self._secret,
                limiter=self._io,
            )
            for i, key, owner, _, location in todo[: outcome.written]:
                if key in self._index:  # replaced (a lock on the key, if any, stays)
                    self._space.release(self._forget(key))
                self._locks.replaced(key)
                self._index[key] = location
                self._room.indexed(key, owner, record_size(location[2]))
                if not self._locks.is_locked(key):
                    self._room.add(key, None if parents is None else parents[i])
                self.counters["stores"] += 1
                self.counters["store_bytes"] += location[2]
                results[i] = True
        finally:
            for _, _, owner, _, location in todo:  # (now objects, or given back)
                self._room.unreserve(owner, record_size(location[2]))
            for _, _, _, _, location in todo[outcome.written :]:  # never written (whole)
                self._space.release(location)
            await self._free()
        error = outcome.error
        if outcome.space is not None:
            self._measured(*outcome.space)
        if error is not None and error.errno in (errno.ENOSPC, errno.EDQUOT):
            self.counters["store_refused"] += len(todo) - outcome.written
            self.counters["full"] += 1
            # The filesystem is fuller than measured (another writer, or space not reported):
            # keep at most what is on it now, less a tenth, and evict down to that.
            self._room.capacity = min(self._room.capacity, int(self._room.bytes * 0.9))
            log.warning(
                "disk L2 %s: filesystem full; capacity lowered to %d bytes",
                self.root,
                self._room.capacity,
            )
            self._make_room(0, b"")
            await self._free()
        elif error is not None:
            self.counters["errors"] += 1
            raise BackendError(f"disk: writing an object failed: {reason(error)}")
        return results

    async def names(self, prefix: bytes, limit: int) -> list[tuple[bytes, bytes]]:
        """``(key, names)`` of the objects under ``prefix`` stored with names, the newest first,
        at most ``limit`` bytes of names (:func:`._diskio.read_names`, a worker thread: two
        reads an object); an object replaced or removed meanwhile is left out. Raises
        BackendError. Cancellation: the thread runs to its end, unused."""
        await self._ensure_index()
        keys = list(self._index)  # (a copy in C; filtered in the thread)
        try:
            found = await trio.to_thread.run_sync(
                read_names, keys, self._index, prefix, limit, self._path, self._secret,
                limiter=self._io,
            )  # fmt: skip
        except OSError as exc:
            self.counters["errors"] += 1
            raise BackendError(f"disk: reading names failed: {reason(exc)}") from None
        return [(key, names) for key, at, names in found if self._index.get(key) == at]

    async def delete(self, keys: Sequence[bytes]) -> None:
        await self._ensure_index()
        for key in keys:
            if key in self._index and not self._locks.defer_delete(key):
                self._space.release(self._forget(key))
        if not await self._free():
            await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        """Release the directory's lock (the backend is done). Cancelled: released anyway."""
        self._lock.release()
        await trio.lowlevel.checkpoint()

    def statistics(self) -> Mapping[str, float]:
        return {
            "objects": len(self._index),
            "bytes": self._room.bytes,
            "capacity_bytes": self._room.capacity,
            "owners": self._room.owners,
            "segments": len(self._space),
            "locks": self._locks.total,
            **self.counters,
        }

    # ----------------------------------------------------------------- segments

    def _forget(self, key: bytes) -> Location:
        location = self._index.pop(key)
        self._room.forgotten(key, record_size(location[2]))
        return location

    async def _free(self) -> bool:
        """Punch the ranges and unlink the segments given back so far, in a worker thread,
        shielded (the index no longer has them: their space must not be left behind). Failures
        are counted and logged, not raised. Returns whether there was anything to free."""
        frees = self._space.take_frees()
        if frees is None:
            return False
        punches = [(self._path(s), o, record_size(n)) for s, o, n in frees.punches]
        unlinks = [self._path(s) for s in frees.unlinks]
        with trio.CancelScope(shield=True):
            freed = await trio.to_thread.run_sync(
                free_ranges, punches, unlinks, self._secret, limiter=self._io
            )
        if freed.unsupported and not self._punch_warned:
            self._punch_warned = True
            log.warning(
                "disk L2 %s: the filesystem cannot punch holes; the space of removed objects "
                "comes back only when their segment file is removed",
                self.root,
            )
        if freed.error is not None:
            self.counters["free_errors"] += freed.failed
            log.warning(
                "disk L2 %s: %d range(s) or file(s) could not be freed (%s)",
                self.root,
                freed.failed,
                reason(freed.error),
            )
        return True

    # ----------------------------------------------------------------- capacity

    async def _remeasure(self) -> None:
        """While the capacity is below the option (the filesystem was full), measure the free
        space again, at most once a second: room freed by others raises it back even when
        nothing could be written (writes measure anyway)."""
        now = trio.current_time()
        if self._room.capacity >= int(self.options.capacity) or now < self._measured_at + 1.0:
            return
        self._measured_at = now
        try:
            free, total = await trio.to_thread.run_sync(
                filesystem_space, self._segments_dir, limiter=self._io
            )
        except OSError as exc:
            raise BackendError(f"disk: cannot use {self.root}: {reason(exc)}") from None
        self._measured(free, total)

    def _make_room(self, size: int, owner: bytes) -> bool:
        """Evict unlocked objects until ``size`` more bytes for ``owner`` fit (the capacity and
        the owner's cap), taking them from whom :meth:`Room.victims` says.

        O(evicted objects × owners): locked objects are not in the policies, so none is
        skipped. The index forgets them at once; their records are queued for :meth:`_free`."""
        if size > self._room.cap():
            return False
        for key in self._room.victims(owner, size):
            self._space.release(self._forget(key))
            self.counters["evictions"] += 1
        return self._room.fits(owner, size)
