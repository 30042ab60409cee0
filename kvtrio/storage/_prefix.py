"""The common part of the prefix-aware policies: nodes, pins, parents and tail-first order.

A chunk is useful only while every chunk before it is stored (a lookup stops at the first miss),
so every policy here knows each key's parent (the chunk before it in its prompt, given by the
store path) and follows two rules:

- **Orphans go first.** When a chunk is evicted or dropped, the chunks stored after it (its
  *kids*, then theirs in turn as they go) can never hit again: they move to an orphan list that
  is evicted before anything else, whatever their history.
- **Tail before head.** Chunks of one prompt usually arrive head first (and, with several
  ranks, interleaved with the other ranks' chunks); a chunk whose parent sits in the queue it
  joins is linked just *before* the parent, so the prompt leaves tail first (with plain LRU the
  head, oldest, would go first and leave the rest unreachable).

Subclasses decide where a new or released node goes and which node :meth:`_choose` gives up
next. All operations are O(1) amortised: a node is orphaned at most once, a parent's list of
kids is pruned of stale entries when it doubles, and a subclass's scan passes over a node
without evicting it only by using up one unit of its bounded frequency or moving it to
another queue.
"""

from __future__ import annotations

from collections.abc import Iterator

from ._linked import Node, NodeList

__all__ = ["PrefixPolicy"]


class PrefixPolicy:
    """Base class: key → :class:`Node`, held (pinned) nodes keep their history."""

    name = ""

    def __init__(self) -> None:
        self._nodes: dict[bytes, Node] = {}
        self._victim: bytes | None = None
        self._orphans = NodeList("orphans")
        self._evictable = 0

    def __len__(self) -> int:
        return self._evictable

    # ------------------------------------------------------------- EvictionPolicy

    def add(self, key: bytes, parent: bytes | None = None) -> None:
        """``key`` became evictable: new (admitted by the subclass) or released after a hold."""
        node = self._nodes.get(key)
        if node is None:
            node = Node(key, parent)
            self._nodes[key] = node
            self._adopt(node)
            self._admit(node)
        elif node.queue is None:
            if parent is not None:
                node.parent = parent
            self._release(node)
        else:
            self.touch(key)
            return
        self._evictable += 1

    def hold(self, key: bytes) -> None:
        """``key`` is pinned: out of the eviction order until the next :meth:`add`, history kept."""
        node = self._nodes.get(key)
        if node is not None and node.queue is not None:
            self._unlink(node)

    def discard(self, key: bytes) -> None:
        """``key`` is gone; if it is the victim just yielded, it was evicted (see ``_evicted``)."""
        node = self._nodes.pop(key, None)
        evicted = key == self._victim
        self._victim = None
        if node is None:
            return
        if node.queue is not None:
            self._unlink(node)
        self._orphan_kids(node)
        if evicted:
            self._evicted(node)

    def touch(self, key: bytes) -> None:
        node = self._nodes.get(key)
        if node is not None:
            self._hit(node)

    def victims(self) -> Iterator[bytes]:
        """Orphans first, then the subclass's choice; each key yielded stays linked until the
        caller discards it."""
        while True:
            node = self._orphans.front() or self._choose()
            if node is None:
                return
            self._victim = node.key
            yield node.key

    # ------------------------------------------------------------- for subclasses

    def _choose(self) -> Node | None:
        """The next node to evict (left linked), or None if nothing is evictable."""
        raise NotImplementedError

    def _admit(self, node: Node) -> None:
        raise NotImplementedError

    def _release(self, node: Node) -> None:
        self._place(node, node.home or self._default_home())

    def _default_home(self) -> NodeList:
        raise NotImplementedError

    def _hit(self, node: Node) -> None:
        raise NotImplementedError

    def _evicted(self, node: Node) -> None:
        """An evicted node (already unlinked and forgotten); e.g. remember it as a ghost."""

    def _place(self, node: Node, queue: NodeList) -> None:
        """Link ``node`` into ``queue``: just before its parent if the parent sits in the same
        queue (a chunk is never worth more than its parent: every hit on it hits the parent),
        at the back otherwise."""
        parent = self._nodes.get(node.parent) if node.parent is not None else None
        if parent is not None and parent.queue is queue:
            queue.insert_before(node, parent)
        else:
            queue.append(node)

    def _unlink(self, node: Node) -> None:
        assert node.queue is not None
        node.queue.unlink(node)
        self._evictable -= 1

    def _orphan(self, node: Node) -> bool:
        """Whether ``node`` can never hit again: its parent is not stored any more."""
        return node.home is self._orphans or (
            node.parent is not None and node.parent not in self._nodes
        )

    def _adopt(self, node: Node) -> None:
        """Record ``node`` among its parent's kids (if the parent is known)."""
        parent = self._nodes.get(node.parent) if node.parent is not None else None
        if parent is None:
            return
        kids = parent.kids
        if kids is None:
            parent.kids = [node]
            return
        if len(kids) >= 8 and len(kids) & (len(kids) - 1) == 0:  # at powers of two: prune
            nodes = self._nodes
            kids[:] = [kid for kid in kids if nodes.get(kid.key) is kid]
        kids.append(node)

    def _orphan_kids(self, node: Node) -> None:
        """``node`` is gone: its live kids can never hit again; they go first from now on."""
        kids, node.kids = node.kids, None
        if not kids:
            return
        nodes, orphans = self._nodes, self._orphans
        for kid in kids:
            if nodes.get(kid.key) is not kid or kid.home is orphans:
                continue
            if kid.queue is not None:
                kid.queue.unlink(kid)
                orphans.append(kid)
            else:
                kid.home = orphans  # held: goes to the orphans when released
