"""ARC (Megiddo & Modha, FAST'03), prefix-aware: recency and frequency, balanced adaptively.

Chunks used once live in T1, chunks used again in T2, each in LRU order; ghost lists B1 and B2
remember keys recently evicted from each. A store of a key found in B1 means T1 was too small:
the target size ``p`` of T1 grows; one found in B2 shrinks it. The victim comes from T1 while
T1 is above its target, from T2 otherwise. So a scan of one-off prompts cannot flush the reused
chunks out of T2, and a workload that lives on recency (growing conversations) lets T1 take the
room. The cache size ``c`` is the most keys the policy has tracked at once (not the current
count: while a large store's chunks are being written they are not tracked, and a ``c`` that
dipped would trim the ghost lists for good). On top, the prefix rules of
:mod:`._prefix`: orphans go at once, a prompt's tail before its head.
"""

from __future__ import annotations

from collections import OrderedDict

from ._linked import Node, NodeList
from ._prefix import PrefixPolicy

__all__ = ["ARC"]


class ARC(PrefixPolicy):
    name = "arc"

    def __init__(self) -> None:
        super().__init__()
        self._t1 = NodeList("t1")
        self._t2 = NodeList("t2")
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._p = 0.0
        self._size = 1  # c: the high-water mark of len(self._nodes)

    def _admit(self, node: Node) -> None:
        b1, b2 = self._b1, self._b2
        size = self._size = max(self._size, len(self._nodes))
        if b1.pop(node.key, 0) is None:
            self._p = min(float(size), self._p + max(len(b2) / max(len(b1), 1), 1.0))
            self._place(node, self._t2)
        elif b2.pop(node.key, 0) is None:
            self._p = max(0.0, self._p - max(len(b1) / max(len(b2), 1), 1.0))
            self._place(node, self._t2)
        else:
            self._place(node, self._t1)

    def _default_home(self) -> NodeList:
        return self._t1

    def _hit(self, node: Node) -> None:
        t1, t2 = self._t1, self._t2
        queue = node.queue
        if queue is t2:
            t2.move_to_back(node)
        elif queue is t1:
            t1.unlink(node)
            t2.append(node)
        elif node.home is t1:  # held
            node.home = t2

    def touch(self, key: bytes) -> None:  # the lookup path: no extra call
        node = self._nodes.get(key)
        if node is not None:
            if node.queue is self._t2:
                self._t2.move_to_back(node)
            else:
                self._hit(node)

    def _evicted(self, node: Node) -> None:
        if self._orphan(node):
            return
        ghosts = self._b1 if node.home is self._t1 else self._b2
        ghosts[node.key] = None
        limit = self._size
        while len(self._b1) + len(self._b2) > limit:
            (self._b1 if len(self._b1) >= len(self._b2) else self._b2).popitem(last=False)

    def _choose(self) -> Node | None:
        t1, t2 = self._t1, self._t2
        if not t1.count and not t2.count:
            return None
        return (t1 if t1.count and (t1.count > self._p or not t2.count) else t2).front()
