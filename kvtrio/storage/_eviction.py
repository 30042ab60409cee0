"""Eviction policies, kept apart from storage (vLLM kv_offload style).

A policy sees only the keys that may be evicted right now: the L1 adds a key when it becomes
ready and unpinned, holds it while it is pinned, and discards it when it is dropped.
``victims()`` then yields keys in the order they should go; every key it yields is evictable.

``add`` takes the key's *parent*, the chunk before it in its prompt (None for a first chunk or
when unknown): a chunk can only hit while its parent is stored, which prefix-aware policies use
(see :mod:`._prefix`). Policies are chosen by name from :mod:`._policies`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

__all__ = ["LRU", "EvictionPolicy"]


class EvictionPolicy(Protocol):
    def add(self, key: bytes, parent: bytes | None = None) -> None:
        """``key`` became evictable (new, or released after :meth:`hold`); ``parent`` is the
        chunk before it in its prompt, if known."""

    def hold(self, key: bytes) -> None:
        """``key`` is pinned: not evictable until the next :meth:`add` of it; a policy may keep
        its history. Unknown keys are ignored."""

    def discard(self, key: bytes) -> None:
        """``key`` is gone (evicted or dropped); forget it. Unknown keys are ignored."""

    def touch(self, key: bytes) -> None:
        """``key`` was used (a hit); unknown keys are ignored."""

    def victims(self) -> Iterator[bytes]:
        """Evictable keys, first to evict first. The caller discards each one it evicts."""
        ...

    def __len__(self) -> int: ...


class LRU:
    """Plain least recently used first, blind to prefixes. O(1) for every operation."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    name = "lru"

    def add(self, key: bytes, parent: bytes | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def hold(self, key: bytes) -> None:
        self._order.pop(key, None)

    def discard(self, key: bytes) -> None:
        self._order.pop(key, None)

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def victims(self) -> Iterator[bytes]:
        while self._order:
            yield next(iter(self._order))

    def __len__(self) -> int:
        return len(self._order)
