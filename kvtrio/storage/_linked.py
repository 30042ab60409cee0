"""An intrusive doubly linked list of policy nodes: O(1) append, insert-before, unlink.

The prefix-aware policies keep their own lists (rather than ``OrderedDict``) because they need
one operation ``OrderedDict`` lacks: putting a chunk right *before* its parent, so that a prompt
committed head first still leaves in tail-first order.
"""

from __future__ import annotations

__all__ = ["Node", "NodeList"]


class Node:
    """One key known to a policy: ``queue`` is the list it is linked in (None while held),
    ``home`` the list it returns to when released."""

    __slots__ = (
        "freq",
        "gap",
        "home",
        "key",
        "kids",
        "kind",
        "next",
        "parent",
        "prev",
        "queue",
        "stamp",
        "visited",
    )

    def __init__(self, key: bytes, parent: bytes | None) -> None:
        self.key = key
        self.parent = parent
        self.prev: Node | None = None
        self.next: Node | None = None
        self.queue: NodeList | None = None
        self.home: NodeList | None = None
        self.kids: list[Node] | None = None  # nodes added with this one as parent (some stale)
        self.freq = 0
        self.visited = False
        self.kind = 0  # the reuse predictor's class (``_reuse``)
        self.stamp = 0  # the reuse predictor's clock at the last use
        self.gap = 0  # the reuse predictor's last gap between two uses (0: none yet)


class NodeList:
    """Front = oldest = first to leave; back = newest."""

    __slots__ = ("_head", "_tail", "count", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._head: Node | None = None
        self._tail: Node | None = None
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def front(self) -> Node | None:
        return self._head

    def append(self, node: Node) -> None:
        """Link ``node`` at the back (newest)."""
        node.prev, node.next, node.queue, node.home = self._tail, None, self, self
        if self._tail is None:
            self._head = node
        else:
            self._tail.next = node
        self._tail = node
        self.count += 1

    def insert_before(self, node: Node, ref: Node) -> None:
        """Link ``node`` just before ``ref`` (which must be in this list): it leaves first."""
        node.prev, node.next, node.queue, node.home = ref.prev, ref, self, self
        if ref.prev is None:
            self._head = node
        else:
            ref.prev.next = node
        ref.prev = node
        self.count += 1

    def move_to_back(self, node: Node) -> None:
        """Make ``node`` (which must be in this list) the newest."""
        after = node.next
        if after is None:
            return
        before = node.prev
        if before is None:
            self._head = after
        else:
            before.next = after
        after.prev = before
        tail = self._tail
        assert tail is not None
        tail.next = node
        node.prev, node.next = tail, None
        self._tail = node

    def unlink(self, node: Node) -> None:
        """Remove ``node`` (which must be in this list)."""
        if node.prev is None:
            self._head = node.next
        else:
            node.prev.next = node.next
        if node.next is None:
            self._tail = node.prev
        else:
            node.next.prev = node.prev
        node.prev = node.next = node.queue = None
        self.count -= 1
