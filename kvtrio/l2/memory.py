"""``memory``: objects in this process's memory. For tests, and as the inner backend of the
test backend ``fault`` (``kvtrio.testing.FaultBackend``); it is not shared between processes
and does not survive a restart."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import attrs
import trio

from ..options import ByteSize
from ._interface import Buffers
from ._locks import LocalLocks

__all__ = ["MemoryBackend"]


@attrs.frozen
class MemoryOptions:
    capacity: ByteSize = attrs.field(
        default=ByteSize(1 << 30),
        metadata={"help": "Bytes kept before LRU eviction (unlocked only)."},
    )


class MemoryBackend:
    """An LRU dict of objects with per-key lock counts."""

    name = "memory"
    Options = MemoryOptions
    accepts_touches = True
    """``touch``: objects used from the server's L1 move to the LRU's end."""

    def __init__(self, options: MemoryOptions | None = None) -> None:
        self.options = options or MemoryOptions()
        self._objects: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._locks = LocalLocks()
        self._bytes = 0
        self.counters = collections.Counter[str]()

    async def lookup_and_lock(self, keys: Sequence[bytes]) -> int:
        await trio.lowlevel.checkpoint()
        found = 0
        for key in keys:
            if key not in self._objects or self._locks.is_doomed(key):
                break
            found += 1
        self._locks.lock(keys[:found])
        return found

    async def unlock(self, keys: Sequence[bytes]) -> None:
        """Drop one lock per key, first thing: a cancellation cannot skip it."""
        for key in self._locks.unlock(keys):
            self._drop(key)
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        await trio.lowlevel.checkpoint()
        results = []
        for key, parts in zip(keys, buffers, strict=True):
            data = self._objects.get(key)  # a deleted but locked object still loads
            if data is None or len(data) != sum(len(p) for p in parts):
                results.append(False)
                continue
            self._objects.move_to_end(key)
            offset = 0
            for part in parts:
                part[:] = data[offset : offset + len(part)]
                offset += len(part)
            results.append(True)
        self.counters["loads"] += len(keys)
        return results

    async def touch(self, keys: Sequence[bytes]) -> None:
        """The objects were used (unknown keys are ignored). Cancellation: nothing touched."""
        await trio.lowlevel.checkpoint()
        for key in keys:
            if key in self._objects:
                self._objects.move_to_end(key)

    async def store(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        await trio.lowlevel.checkpoint()
        results = []
        for key, parts in zip(keys, buffers, strict=True):
            data = b"".join(bytes(p) for p in parts)
            # Room first, the object it replaces counted free but kept: a refused store leaves
            # it as it was (was: dropped, also while locked).
            old = self._objects.get(key)
            if not self._make_room(len(data), replacing=key if old is not None else None):
                results.append(False)
                continue
            if old is not None:
                self._drop(key)
            self._locks.replaced(key)
            self._objects[key] = data
            self._bytes += len(data)
            results.append(True)
        self.counters["stores"] += len(keys)
        return results

    async def delete(self, keys: Sequence[bytes]) -> None:
        await trio.lowlevel.checkpoint()
        for key in keys:
            if key not in self._objects:
                continue
            if not self._locks.defer_delete(key):
                self._drop(key)

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()

    def statistics(self) -> Mapping[str, float]:
        return {
            "objects": len(self._objects),
            "bytes": self._bytes,
            "locks": self._locks.total,
            **self.counters,
        }

    def _drop(self, key: bytes) -> None:
        self._bytes -= len(self._objects.pop(key))

    def _make_room(self, size: int, replacing: bytes | None = None) -> bool:
        """Evict unlocked objects, oldest first, until ``size`` bytes fit; ``replacing``: the
        key whose object the new one replaces (its bytes count as free; never evicted)."""
        if size > self.options.capacity:
            return False
        freed = 0 if replacing is None else len(self._objects[replacing])
        for key in list(self._objects):
            if self._bytes - freed + size <= self.options.capacity:
                break
            if key != replacing and not self._locks.is_locked(key):
                self._drop(key)
                self.counters["evictions"] += 1
        return self._bytes - freed + size <= self.options.capacity
