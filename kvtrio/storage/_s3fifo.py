"""S3-FIFO (Yang et al., SOSP'23), prefix-aware: a small probationary FIFO, a main FIFO with
reinsertion, and a ghost FIFO of keys recently evicted from the small one.

New chunks enter the small queue (about a tenth of the evictable keys). A chunk that is hit
while there moves to the main queue when it reaches the front; one that is not leaves the cache
and its key is remembered as a ghost, so that if it is stored again soon it goes straight to
the main queue. The main queue gives each chunk as many second chances as it had hits (at most
``MAX_FREQ``). One-off prompts (the scan-like part of chat and agent traffic) thus pass through
the small queue without pushing shared prefixes and live conversations out. On top, the prefix
rules of :mod:`._prefix`: orphans go at once, a prompt's tail before its head.
"""

from __future__ import annotations

from collections import OrderedDict

from ._linked import Node, NodeList
from ._prefix import PrefixPolicy

__all__ = ["S3FIFO"]

MAX_FREQ = 3


class S3FIFO(PrefixPolicy):
    """See the module docstring. ``small_ratio``: the small queue's share of evictable keys."""

    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1, ghost_ratio: float = 1.0) -> None:
        super().__init__()
        if not 0 < small_ratio < 1:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio}")
        self._ratio = small_ratio
        self._ghost_ratio = ghost_ratio
        self._small = NodeList("small")
        self._main = NodeList("main")
        self._ghosts: OrderedDict[bytes, None] = OrderedDict()

    def _admit(self, node: Node) -> None:
        if self._ghosts.pop(node.key, 0) is None:
            self._place(node, self._main)
        else:
            self._place(node, self._small)

    def _default_home(self) -> NodeList:
        return self._small

    def _hit(self, node: Node) -> None:
        if node.freq < MAX_FREQ:
            node.freq += 1

    def _evicted(self, node: Node) -> None:
        if node.home is self._small and not self._orphan(node):
            ghosts = self._ghosts
            ghosts[node.key] = None
            while len(ghosts) > max(self._ghost_ratio * len(self._nodes), 1):
                ghosts.popitem(last=False)

    def _choose(self) -> Node | None:
        small, main = self._small, self._main
        while small.count or main.count:
            if not main.count or small.count > self._ratio * (small.count + main.count):
                queue = small
            else:
                queue = main
            node = queue.front()
            assert node is not None
            if node.freq and not self._orphan(node):
                queue.unlink(node)
                node.freq = 0 if queue is small else node.freq - 1
                main.append(node)  # promoted, or reinserted
                continue
            return node
        return None
