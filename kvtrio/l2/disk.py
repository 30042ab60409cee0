"""``disk``: one file per object on a local filesystem — the embedded default of ``kvtrio serve``.

One file per object rather than segment files: chunks are large (megabytes), so per-file
overhead is negligible, the filesystem does allocation and reclaims space at once on eviction
(segments would need compaction), a torn or corrupt object damages nothing else, and reads go
straight into L1 slots with ``readv``. Files are written to ``tmp/`` and renamed into
``objects/`` (atomic: a reader sees a whole object or none), optionally fsynced. The index
(key → size, LRU order by modification time) is rebuilt from the directory when the backend is
first used, so a restarted server serves what it stored before. Eviction removes least recently
used objects that are not locked. Blocking file I/O runs in worker threads, at most ``threads``
at once.
"""

from __future__ import annotations

import collections
import contextlib
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import trio

from ..config import ByteSize
from ._interface import BackendError, Buffers
from ._locks import LocalLocks

__all__ = ["DiskBackend"]


@attrs.frozen
class DiskOptions:
    path: str = attrs.field(
        default="~/.cache/kvtrio/l2",
        metadata={"help": "Directory of the objects (created if missing)."},
    )
    capacity: ByteSize = attrs.field(
        default=ByteSize(32 << 30), metadata={"help": "Bytes kept before evicting (LRU, unlocked)."}
    )
    fsync: bool = attrs.field(
        default=False, metadata={"help": "fsync every object before it becomes visible."}
    )
    threads: int = attrs.field(default=4, metadata={"help": "Concurrent file operations."})


class DiskBackend:
    name = "disk"
    Options = DiskOptions

    def __init__(self, options: DiskOptions | None = None) -> None:
        self.options = options or DiskOptions()
        if self.options.threads < 1:
            raise ValueError("threads must be at least 1")
        self.root = Path(os.path.expanduser(self.options.path))
        self._objects_dir = self.root / "objects"
        self._tmp_dir = self.root / "tmp"
        self._io = trio.CapacityLimiter(self.options.threads)  # the "disk I/O" limiter
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._locks = LocalLocks()
        self._bytes = 0
        self._indexed = False
        self._indexing: trio.Event | None = None
        self.counters = collections.Counter[str]()

    # ----------------------------------------------------------------- the index

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self._objects_dir / name[:2] / name

    async def _ensure_index(self) -> None:
        """Scan the directory once (concurrent first callers wait for the one scan)."""
        if self._indexed:
            return
        if self._indexing is not None:
            await self._indexing.wait()
            if self._is_indexed():  # (the first scan may have failed: then try again)
                return
        self._indexing = trio.Event()
        try:
            entries = await trio.to_thread.run_sync(self._scan, limiter=self._io)
        except OSError as exc:
            raise BackendError(f"disk: cannot use {self.root}: {exc.strerror}") from None
        finally:
            self._indexing.set()
        for key, size in entries:
            self._index[key] = size
            self._bytes += size
        self._indexed = True

    def _scan(self) -> list[tuple[bytes, int]]:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # cached KV: this user only
        self._objects_dir.mkdir(parents=True, exist_ok=True)
        self._tmp_dir.mkdir(parents=True, exist_ok=True)
        for leftover in self._tmp_dir.iterdir():  # writes interrupted by a crash
            with contextlib.suppress(OSError):
                leftover.unlink()
        found = []
        for bucket in self._objects_dir.iterdir():
            for entry in os.scandir(bucket):
                try:
                    key = bytes.fromhex(entry.name)
                    stat = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((stat.st_mtime, key, stat.st_size))
        found.sort()  # oldest first: the LRU order
        return [(key, size) for _, key, size in found]

    def _is_indexed(self) -> bool:
        return self._indexed

    def _visible(self, key: bytes) -> bool:
        return key in self._index and not self._locks.is_doomed(key)

    # ----------------------------------------------------------------- the interface

    async def lookup_and_lock(self, keys: Sequence[bytes]) -> int:
        await self._ensure_index()
        await trio.lowlevel.checkpoint()
        found = 0
        for key in keys:
            if not self._visible(key):
                break
            found += 1
        self._locks.lock(keys[:found])
        return found

    async def unlock(self, keys: Sequence[bytes]) -> None:
        await trio.lowlevel.checkpoint()
        gone = self._locks.unlock(keys)
        for key in gone:
            self._forget(key)
        if gone:
            await self._unlink(gone)

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        await self._ensure_index()
        results = []
        for key, parts in zip(keys, buffers, strict=True):
            if key not in self._index:  # (a deleted but locked object still loads)
                results.append(False)
                continue
            try:
                ok = await trio.to_thread.run_sync(
                    _read_object, self._path(key), parts, limiter=self._io
                )
            except OSError as exc:
                self.counters["errors"] += 1
                raise BackendError(f"disk: reading an object failed: {exc.strerror}") from None
            if ok is None:  # the file vanished (removed behind our back)
                self._forget(key)
                ok = False

            elif ok and key in self._index:
                self._index.move_to_end(key)
            self.counters["loads"] += 1
            self.counters["load_bytes"] += sum(len(p) for p in parts) if ok else 0
            results.append(bool(ok))
        return results

    async def store(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        """Reserve room for each object in order, then write the batch in one worker thread.

        Objects written before a failing one are stored (and visible); the failing one and the
        rest are not, and BackendError is raised. Cancellation: the write thread runs to its end
        (each object is temp file + rename, so none is ever torn); reservations not turned into
        objects are released.
        """
        await self._ensure_index()
        results = [False] * len(keys)
        todo: list[tuple[int, bytes, Buffers, int]] = []  # (index, key, parts, reserved size)
        written, error = 0, None
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
            written, error = await trio.to_thread.run_sync(
                _write_objects,
                self._tmp_dir,
                [(self._path(key), parts) for _, key, parts, _ in todo],
                self.options.fsync,
                limiter=self._io,
            )
            for i, key, _, size in todo[:written]:
                if key in self._index:
                    self._bytes -= self._index.pop(key)
                self._locks.replaced(key)
                self._index[key] = size
                self.counters["stores"] += 1
                self.counters["store_bytes"] += size
                results[i] = True
        finally:
            for _, _, _, size in todo[written:]:  # reserved, never written
                self._bytes -= size
        if error is not None:
            self.counters["errors"] += 1
            raise BackendError(f"disk: writing an object failed: {error.strerror}")
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
            "capacity_bytes": self.options.capacity,
            "locks": self._locks.total,
            **self.counters,
        }

    # ----------------------------------------------------------------- internals

    def _forget(self, key: bytes) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size

    async def _make_room(self, size: int) -> bool:
        capacity = self.options.capacity
        if size > capacity:
            return False
        victims = []
        for key in list(self._index):
            if self._bytes + size <= capacity:
                break
            if not self._locks.is_locked(key):
                victims.append(key)
                self._forget(key)
        if victims:
            self.counters["evictions"] += len(victims)
            await self._unlink(victims)
        return self._bytes + size <= capacity

    async def _unlink(self, keys: list[bytes]) -> None:
        paths = [self._path(key) for key in keys]
        await trio.to_thread.run_sync(_unlink_all, paths, limiter=self._io)


# --------------------------------------------------------------------------- worker threads


def _read_object(path: Path, parts: Buffers) -> bool | None:
    """Read the file into ``parts``; False if its size differs, None if it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size != sum(len(p) for p in parts):
            return False
        pending = [memoryview(p).cast("B") for p in parts if len(p)]
        while pending:  # one readv for all parts; loop only on a short read
            count = os.readv(fd, pending)
            if count == 0:
                return False
            while pending and count >= len(pending[0]):
                count -= len(pending[0])
                pending.pop(0)
            if pending and count:
                pending[0] = pending[0][count:]
        return True
    finally:
        os.close(fd)


def _write_object(tmp_dir: Path, path: Path, parts: Buffers, fsync: bool) -> None:
    """Write ``parts`` to a temporary file and rename it to ``path`` (atomic).

    If anything fails (writing, creating the bucket, renaming), the temporary file is removed.
    """
    temp = tmp_dir / uuid.uuid4().hex
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            pending = [memoryview(p).cast("B") for p in parts if len(p)]
            while pending:
                written = os.writev(fd, pending)
                while pending and written >= len(pending[0]):
                    written -= len(pending[0])
                    pending.pop(0)
                if pending and written:
                    pending[0] = pending[0][written:]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        path.parent.mkdir(exist_ok=True)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _write_objects(
    tmp_dir: Path, objects: list[tuple[Path, Buffers]], fsync: bool
) -> tuple[int, OSError | None]:
    """Write the objects in order with :func:`_write_object`; stop at the first that fails.

    Returns how many were written, and the error that stopped it (None if all were).
    """
    for count, (path, parts) in enumerate(objects):
        try:
            _write_object(tmp_dir, path, parts, fsync)
        except OSError as exc:
            return count, exc
    return len(objects), None


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
