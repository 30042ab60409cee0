"""Eviction policies, kept apart from storage (vLLM kv_offload style).

A policy sees only the keys that may be evicted right now: the L1 adds a key when it becomes
ready and unpinned, and removes it when it is pinned or dropped. ``victims()`` then yields keys in
the order they should go; every key it yields is evictable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

__all__ = ["LRU", "EvictionPolicy"]


class EvictionPolicy(Protocol):
    def add(self, key: bytes) -> None:
        """``key`` became evictable."""

    def discard(self, key: bytes) -> None:
        """``key`` is no longer evictable (pinned, or gone). Unknown keys are ignored."""

    def touch(self, key: bytes) -> None:
        """``key`` was used (a hit); unknown keys are ignored."""

    def victims(self) -> Iterator[bytes]:
        """Evictable keys, first to evict first. The caller discards each one it evicts."""
        ...

    def __len__(self) -> int: ...


class LRU:
    """Least recently used first. O(1) for every operation."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

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
