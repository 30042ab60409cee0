"""``disk``: one file per object on a local filesystem — the embedded default of ``kvtrio serve``.

One file per object rather than segment files: chunks are large (megabytes), so per-file
overhead is negligible, the filesystem does allocation and reclaims space at once on eviction
(segments would need compaction), a torn or corrupt object damages nothing else, and reads go
straight into L1 slots with ``readv``. Files are written to ``tmp/`` and renamed into
``objects/`` (atomic: a reader sees a whole object or none), optionally fsynced. The index
(key → size) is rebuilt from the directory when the backend is first used (oldest first, by
modification time), so a restarted server serves what it stored before; files that are not
objects of ours are ignored and reported once. Eviction order is a :class:`kvtrio.storage.
EvictionPolicy` (option ``eviction``, the L1's default) over the unlocked objects, so a store
evicts in O(1) amortised; locked objects are held out of it until unlocked. ``store`` takes each
object's parent (``accepts_parents``), so prefix-aware policies evict a prompt tail first and
the objects after an evicted one first of all; objects found by the scan have no known parent.

Capacity is the smaller of the option and what the filesystem can hold (our bytes plus its free
space, minus a 2% reserve), re-measured after every written batch: a full filesystem (``ENOSPC``)
lowers it, evicts down to it, and refuses the rest of the batch instead of failing for good.
Every filesystem error becomes a :class:`BackendError`; a failed unlink is counted, never raised.
Blocking file I/O runs in worker threads, at most ``threads`` at once (one limiter per backend).
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import trio

from ..config import ByteSize
from ..storage import DEFAULT_EVICTION, EVICTION_POLICIES, EvictionPolicy, make_policy
from ._diskio import (
    Written,
    filesystem_space,
    read_object,
    reason,
    scan_tree,
    unlink_all,
    write_objects,
)
from ._interface import BackendError, Buffers
from ._locks import LocalLocks

__all__ = ["DiskBackend"]

log = logging.getLogger("kvtrio.l2.disk")

_RESERVE = 0.02
"""Fraction of the filesystem kept free: capacity never counts on the last 2% of it."""


@attrs.frozen
class DiskOptions:
    path: str = attrs.field(
        default="~/.cache/kvtrio/l2",
        metadata={"help": "Directory of the objects (created if missing)."},
    )
    capacity: ByteSize = attrs.field(
        default=ByteSize(32 << 30), metadata={"help": "Bytes kept before evicting (unlocked)."}
    )
    eviction: str = attrs.field(
        default=DEFAULT_EVICTION,
        metadata={"help": f"Eviction policy: {', '.join(sorted(EVICTION_POLICIES))}."},
    )
    fsync: bool = attrs.field(
        default=False, metadata={"help": "fsync every object before it becomes visible."}
    )
    threads: int = attrs.field(default=4, metadata={"help": "Concurrent file operations."})


class DiskBackend:
    name = "disk"
    Options = DiskOptions
    accepts_parents = True
    """``store`` takes ``parents=``: the eviction policy knows each object's prompt prefix."""

    def __init__(
        self, options: DiskOptions | None = None, *, policy: EvictionPolicy | None = None
    ) -> None:
        self.options = options or DiskOptions()
        if self.options.threads < 1:
            raise ValueError("threads must be at least 1")
        self.root = Path(os.path.expanduser(self.options.path))
        self._objects_dir = self.root / "objects"
        self._objects_prefix = f"{self._objects_dir}/"
        self._tmp_dir = self.root / "tmp"
        self._io = trio.CapacityLimiter(self.options.threads)  # the "disk I/O" limiter
        self._index: dict[bytes, int] = {}  # every object on disk → its size
        # The unlocked objects; ValueError (naming the known ones) for an unknown name.
        self._policy = policy if policy is not None else make_policy(self.options.eviction)
        self._locks = LocalLocks()
        self._bytes = 0
        self._capacity = int(self.options.capacity)  # lowered to what the filesystem holds
        self._measured_at = -math.inf
        self._indexed = False
        self._indexing: trio.Event | None = None
        self.counters = collections.Counter[str]()

    # ----------------------------------------------------------------- the index

    def _path(self, key: bytes) -> str:
        """The object's file (a str: pathlib's joins cost more than the rest of a lookup)."""
        name = key.hex()
        return f"{self._objects_prefix}{name[:2]}/{name}"

    async def _ensure_index(self) -> None:
        """Create the directories and scan them once (concurrent first callers wait for the one
        scan; a failed scan is tried again by the next call). Raises BackendError (one line) if
        the path cannot be used. Cancellation: the scan thread runs to its end, unused."""
        if self._indexed:
            return
        if self._indexing is not None:
            await self._indexing.wait()
            if self._is_indexed():  # (the first scan may have failed: then try again)
                return
        self._indexing = trio.Event()
        try:
            found = await trio.to_thread.run_sync(
                scan_tree, self._objects_dir, self._tmp_dir, limiter=self._io
            )
        except OSError as exc:
            raise BackendError(f"disk: cannot use {self.root}: {reason(exc)}") from None
        finally:
            self._indexing.set()
        for key, size in found.objects:
            self._index[key] = size
            self._policy.add(key)
            self._bytes += size
        self._indexed = True
        self._measured(found.free, found.total)
        if found.foreign:
            self.counters["foreign_files"] = len(found.foreign)
            log.warning(
                "disk L2 %s: ignoring %d file(s) that are not objects (e.g. %s)",
                self.root,
                len(found.foreign),
                found.foreign[0],
            )

    def _is_indexed(self) -> bool:
        return self._indexed

    def _visible(self, key: bytes) -> bool:
        return key in self._index and not self._locks.is_doomed(key)

    def _measured(self, free: int, total: int) -> None:
        """Set the capacity from the filesystem's free space (measured with our bytes on it)."""
        fits = max(self._bytes + free - int(total * _RESERVE), 0)
        capacity = min(int(self.options.capacity), fits)
        if capacity < self._capacity and capacity < int(self.options.capacity):
            log.info(
                "disk L2 %s: the filesystem holds %d bytes for objects, less than capacity",
                self.root,
                capacity,
            )
        self._capacity = capacity

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
            self._policy.touch(key)
        for key in keys[:found]:
            self._policy.hold(key)  # locked: not evictable until its last unlock
        self._locks.lock(keys[:found])
        return found

    async def unlock(self, keys: Sequence[bytes]) -> None:
        """Drop one lock per key, first thing (a cancellation cannot skip it); remove the files
        of objects deleted while locked (the thread runs to its end if cancelled)."""
        was_locked = [key for key in keys if self._locks.is_locked(key)]
        gone = self._locks.unlock(keys)
        for key in was_locked:
            if key in self._index and not self._locks.is_locked(key):
                self._policy.add(key)
        for key in gone:
            self._forget(key)
        if gone:
            await self._unlink(gone)
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        await self._ensure_index()
        results = []
        for key, parts in zip(keys, buffers, strict=True):
            if key not in self._index:  # (a deleted but locked object still loads)
                results.append(False)
                continue
            try:
                ok = await trio.to_thread.run_sync(
                    read_object, self._path(key), parts, limiter=self._io
                )
            except OSError as exc:
                self.counters["errors"] += 1
                raise BackendError(f"disk: reading an object failed: {reason(exc)}") from None
            if ok is None:  # the file vanished (removed behind our back)
                self._forget(key)
                ok = False
            elif ok:
                self._policy.touch(key)
            self.counters["loads"] += 1
            self.counters["load_bytes"] += sum(len(p) for p in parts) if ok else 0
            results.append(bool(ok))
        return results

    async def store(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Buffers],
        *,
        parents: Sequence[bytes | None] | None = None,
    ) -> list[bool]:
        """Reserve room for each object in order, then write the batch in one worker thread.

        ``parents`` (optional, index-aligned) names the object before each one in its prompt,
        for the eviction policy: a prompt leaves tail first, and objects after an evicted one
        (unreachable by a prefix lookup) go first.

        Objects written before a failing one are stored (and visible); the failing one and the
        rest are not. A full filesystem lowers the capacity and evicts down to it (the rest of
        the batch is refused, not an error); any other failure raises BackendError.
        Cancellation: the write thread runs to its end (each object is temp file + rename, so
        none is ever torn); reservations not turned into objects are released.
        """
        await self._ensure_index()
        await self._remeasure()
        results = [False] * len(keys)
        todo: list[tuple[int, bytes, Buffers, int]] = []  # (index, key, parts, reserved size)
        outcome = Written(0, None, None)
        try:
            for i, (key, parts) in enumerate(zip(keys, buffers, strict=True)):
                size = sum(len(p) for p in parts)
                if not await self._make_room(size):
                    self.counters["store_refused"] += 1
                    continue
                self._bytes += size  # reserved now, so concurrent stores do not overshoot
                todo.append((i, key, parts, size))
            if not todo:
                return results
            outcome = await trio.to_thread.run_sync(
                write_objects,
                self._tmp_dir,
                [(self._path(key), parts) for _, key, parts, _ in todo],
                self.options.fsync,
                limiter=self._io,
            )
            for i, key, _, size in todo[: outcome.written]:
                if key in self._index:
                    self._bytes -= self._index[key]
                self._locks.replaced(key)
                self._index[key] = size
                if not self._locks.is_locked(key):
                    self._policy.add(key, None if parents is None else parents[i])
                self.counters["stores"] += 1
                self.counters["store_bytes"] += size
                results[i] = True
        finally:
            for _, _, _, size in todo[outcome.written :]:  # reserved, never written
                self._bytes -= size
        error = outcome.error
        if outcome.space is not None:
            self._measured(*outcome.space)
        if error is not None and error.errno in (errno.ENOSPC, errno.EDQUOT):
            self.counters["store_refused"] += len(todo) - outcome.written
            self.counters["full"] += 1
            # The filesystem is fuller than measured (another writer, or space not reported):
            # keep at most what is on it now, less a tenth, and evict down to that.
            self._capacity = min(self._capacity, int(self._bytes * 0.9))
            log.warning(
                "disk L2 %s: filesystem full; capacity lowered to %d bytes",
                self.root,
                self._capacity,
            )
            await self._make_room(0)
        elif error is not None:
            self.counters["errors"] += 1
            raise BackendError(f"disk: writing an object failed: {reason(error)}")
        return results

    async def delete(self, keys: Sequence[bytes]) -> None:
        await self._ensure_index()
        gone = []
        for key in keys:
            if key not in self._index:
                continue
            if not self._locks.defer_delete(key):
                self._forget(key)
                gone.append(key)
        if gone:
            await self._unlink(gone)
        else:
            await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()

    def statistics(self) -> Mapping[str, float]:
        return {
            "objects": len(self._index),
            "bytes": self._bytes,
            "capacity_bytes": self._capacity,
            "locks": self._locks.total,
            **self.counters,
        }

    # ----------------------------------------------------------------- internals

    def _forget(self, key: bytes) -> None:
        size = self._index.pop(key, None)
        self._policy.discard(key)
        if size is not None:
            self._bytes -= size

    async def _remeasure(self) -> None:
        """While the capacity is below the option (the filesystem was full), measure the free
        space again, at most once a second: room freed by others raises it back even when
        nothing could be written (writes measure anyway)."""
        now = trio.current_time()
        if self._capacity >= int(self.options.capacity) or now < self._measured_at + 1.0:
            return
        self._measured_at = now
        try:
            free, total = await trio.to_thread.run_sync(
                filesystem_space, self._objects_dir, limiter=self._io
            )
        except OSError as exc:
            raise BackendError(f"disk: cannot use {self.root}: {reason(exc)}") from None
        self._measured(free, total)

    async def _make_room(self, size: int) -> bool:
        """Evict unlocked objects in the policy's order until ``size`` more bytes fit.

        O(evicted objects): locked objects are not in the policy, so none is skipped. The files
        are removed in a worker thread; the index forgets them at once (no checkpoint between
        the check and the reservation that follows)."""
        capacity = self._capacity
        if size > capacity:
            return False
        victims = []
        if self._bytes + size > capacity:
            for key in self._policy.victims():
                victims.append(key)
                self._forget(key)
                if self._bytes + size <= capacity:
                    break
        if victims:
            self.counters["evictions"] += len(victims)
            await self._unlink(victims)
        return self._bytes + size <= capacity

    async def _unlink(self, keys: list[bytes]) -> None:
        """Remove the files (in a worker thread). Failures are counted and logged, not raised:
        the objects are already out of the index. Cancellation: the thread runs to its end."""
        paths = [self._path(key) for key in keys]
        failed = await trio.to_thread.run_sync(unlink_all, paths, limiter=self._io)
        if failed is not None:
            count, error = failed
            self.counters["unlink_errors"] += count
            log.warning(
                "disk L2 %s: %d file(s) could not be removed (%s)",
                self.root,
                count,
                reason(error),
            )
