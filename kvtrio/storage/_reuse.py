"""Reuse-predicting eviction (issue 37): evict the chunk predicted to be used last.

A relaxed Belady (``--eviction reuse``; not the default: on the held-out halves of
docs/eviction.md it matches LRU, no better). Every chunk is in one of a few *classes*, an
explainable guess of how likely it is to be used again, from what the cache sees when it is
stored or used:

- ``new``: a new chunk whose prompt hit nothing before it (its parent is new too, or it has
  none): the first turn of a conversation, a new document;
- ``tail``: a new chunk that continues a prefix that hit (its parent was used again, or is
  such a tail itself): the part of a prompt after its reused history (on the Mooncake trace
  used again 2-9 % of the time);
- each of those two split by whether a chunk was stored after it yet (``...-leaf``: the last
  chunk of its prompt so far, rarely continued);
- ``hit1``, ``hit2``, ``hit3``: chunks used again once, twice, three times or more (a chunk
  evicted and asked for again keeps its count: recently evicted keys are remembered as
  *ghosts*, as many as the most chunks the policy has held).

Each class keeps its chunks in a queue in order of last use (with the prefix rules of
:mod:`._prefix`: orphans first, a prompt's tail before its head) and an online estimate,
halved every :data:`_DECAY_EVERY` entries, of the share of its chunks used again (ghosts
count) and of their mean gap in accesses. Each chunk that was used again keeps its own gap
(the mean of its last gaps). A chunk's **predicted next use** is its last use plus its own
gap, or its class's mean gap over its class's share if it has none; once it has waited
longer than that (overdue), twice its age. The victim is the least recently used chunk of
the class whose such chunk is predicted to be used last. O(classes) per eviction, O(1) per
access; per chunk three ints on its node, and the ghosts.
"""

from __future__ import annotations

from collections import OrderedDict

from ._linked import Node, NodeList
from ._prefix import PrefixPolicy

__all__ = ["KINDS", "ReusePolicy"]

NEW, NEW_LEAF, TAIL, TAIL_LEAF, HIT1 = range(5)
KINDS = ("new", "new-leaf", "tail", "tail-leaf", "hit1", "hit2", "hit3")
_DECAY_EVERY = 1 << 14
"""Class entries between two halvings of the estimates."""


class ReusePolicy(PrefixPolicy):
    name = "reuse"

    def __init__(self) -> None:
        super().__init__()
        self._queues = [NodeList(kind) for kind in KINDS]
        self._entered = [1.0] * len(KINDS)
        self._reused = [0.5] * len(KINDS)
        self._gaps = [1000.0] * len(KINDS)  # sum of gaps of the reused, prior mean 2,000
        self._ghosts: OrderedDict[bytes, tuple[int, int, int]] = OrderedDict()
        self._clock = 0
        self._since_decay = 0
        self._size = 1

    # ------------------------------------------------------------- learning

    def _enter(self, node: Node, kind: int) -> None:
        node.kind = kind
        node.stamp = self._clock
        self._entered[kind] += 1.0
        self._since_decay += 1
        if self._since_decay >= _DECAY_EVERY:
            self._since_decay = 0
            self._entered = [x / 2 for x in self._entered]
            self._reused = [x / 2 for x in self._reused]
            self._gaps = [x / 2 for x in self._gaps]

    def _learn(self, kind: int, stamp: int) -> int:
        gap = self._clock - stamp
        self._reused[kind] += 1.0
        self._gaps[kind] += gap
        return gap

    # ------------------------------------------------------------- PrefixPolicy

    def _admit(self, node: Node) -> None:
        self._clock += 1
        self._size = max(self._size, len(self._nodes))
        ghost = self._ghosts.pop(node.key, None)
        if ghost is not None:  # used again after it was evicted: its class learns
            gap = self._learn(ghost[0], ghost[1])
            node.gap = gap if not ghost[2] else (ghost[2] + gap) // 2
            node.freq = ghost[0] - HIT1 + 2 if ghost[0] >= HIT1 else 1
            kind = HIT1 + min(node.freq, 3) - 1
        else:
            parent = self._nodes.get(node.parent) if node.parent is not None else None
            if parent is None:
                kind = NEW_LEAF
            else:
                if parent.kind == NEW_LEAF or parent.kind == TAIL_LEAF:
                    self._move(parent, parent.kind - 1)
                kind = TAIL_LEAF if parent.freq or parent.kind in (TAIL, TAIL_LEAF) else NEW_LEAF
        self._enter(node, kind)
        self._place(node, self._queues[kind])

    def _move(self, node: Node, kind: int) -> None:
        """Reclassify ``node`` without counting an entry (a leaf that got a successor)."""
        self._entered[node.kind] -= 1.0
        self._entered[kind] += 1.0
        node.kind = kind
        queue = node.queue
        if queue is None:
            if node.home is not self._orphans:
                node.home = self._queues[kind]
        elif queue is not self._orphans:  # (an orphan stays one)
            queue.unlink(node)
            self._place(node, self._queues[kind])

    def _default_home(self) -> NodeList:
        return self._queues[NEW_LEAF]

    def _hit(self, node: Node) -> None:
        self._clock += 1
        gap = self._learn(node.kind, node.stamp)
        node.gap = gap if not node.gap else (node.gap + gap) // 2
        node.freq += 1
        kind = HIT1 + min(node.freq, 3) - 1
        self._enter(node, kind)
        queue = node.queue
        if queue is None:
            if node.home is not self._orphans:
                node.home = self._queues[kind]
        elif queue is not self._orphans:
            queue.unlink(node)
            self._queues[kind].append(node)

    def _evicted(self, node: Node) -> None:
        if self._orphan(node):
            return
        ghosts = self._ghosts
        ghosts[node.key] = (node.kind, node.stamp, node.gap)
        while len(ghosts) > self._size:
            ghosts.popitem(last=False)

    def _choose(self) -> Node | None:
        """Of the least recently used chunk of each class, the one predicted to be used last:
        at its last use plus its own mean gap if it has one (an overdue one: twice its age),
        else plus its class's mean gap over its class's reuse share."""
        best: Node | None = None
        latest = -1.0
        clock = self._clock
        entered, reused, gaps = self._entered, self._reused, self._gaps
        for kind, queue in enumerate(self._queues):
            node = queue.front()
            if node is None:
                continue
            if node.gap:
                gap = float(node.gap)
            else:
                r = reused[kind]
                gap = gaps[kind] / r * max(entered[kind], r) / r
            age = clock - node.stamp
            when = node.stamp + (gap if age <= gap else 2.0 * age)
            if when > latest:
                best, latest = node, when
        return best
