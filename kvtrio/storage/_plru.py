"""Prefix-aware LRU: least recently used first, with the prefix rules of :mod:`._prefix`."""

from __future__ import annotations

from ._linked import Node, NodeList
from ._prefix import PrefixPolicy

__all__ = ["PrefixLRU"]


class PrefixLRU(PrefixPolicy):
    name = "plru"

    def __init__(self) -> None:
        super().__init__()
        self._queue = NodeList("lru")

    def _admit(self, node: Node) -> None:
        self._place(node, self._queue)

    def _default_home(self) -> NodeList:
        return self._queue

    def _hit(self, node: Node) -> None:
        if node.queue is self._queue:
            self._queue.move_to_back(node)

    def _choose(self) -> Node | None:
        return self._queue.front()
