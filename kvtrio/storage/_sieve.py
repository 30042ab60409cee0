"""SIEVE (Zhang et al., NSDI'24), prefix-aware: one FIFO, a visited bit, a hand.

New chunks join at the back. The hand moves from the front (oldest) towards the back: a visited
chunk has its bit cleared and stays where it is, an unvisited one is evicted; at the back the
hand wraps to the front. Chunks that keep being hit stay without being moved, new chunks that
are never hit leave soon. On top, the prefix rules of :mod:`._prefix`.
"""

from __future__ import annotations

from ._linked import Node, NodeList
from ._prefix import PrefixPolicy

__all__ = ["Sieve"]


class Sieve(PrefixPolicy):
    name = "sieve"

    def __init__(self) -> None:
        super().__init__()
        self._queue = NodeList("fifo")
        self._hand: Node | None = None

    def _admit(self, node: Node) -> None:
        self._place(node, self._queue)

    def _default_home(self) -> NodeList:
        return self._queue

    def _hit(self, node: Node) -> None:
        node.visited = True

    def _unlink(self, node: Node) -> None:
        if self._hand is node:
            self._hand = node.next
        super()._unlink(node)

    def _choose(self) -> Node | None:
        queue = self._queue
        while queue.count:
            node = self._hand or queue.front()
            assert node is not None
            if node.visited and not self._orphan(node):
                node.visited = False
                self._hand = node.next
                continue
            self._hand = node
            return node
        return None
