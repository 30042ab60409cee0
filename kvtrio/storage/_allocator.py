"""Byte ranges of the L1 arena: first-fit allocation with coalescing, exact-size reuse in O(1)."""

from __future__ import annotations

import bisect

__all__ = ["ExtentAllocator"]


class ExtentAllocator:
    """Hands out ``[offset, offset + n)`` ranges of a region of ``size`` bytes.

    Sizes are rounded up to ``alignment``. Freed ranges merge with free neighbours. A free range
    of exactly the requested size is found in O(1) (chunks of one model all have one size, so
    after the first eviction this is the common case); otherwise the lowest-addressed free range
    that fits is split. Synchronous, no I/O.
    """

    def __init__(self, size: int, alignment: int = 4096, base: int = 0) -> None:
        self.size = size - size % alignment
        self.alignment = alignment
        # ``base``: the first offset handed out (per-tenant arenas live at distinct bases).
        self._starts: list[int] = [base] if self.size else []  # sorted offsets of free ranges
        self._length: dict[int, int] = {base: self.size} if self.size else {}
        self._by_length: dict[int, set[int]] = {self.size: {base}} if self.size else {}
        self.free_bytes = self.size

    def round(self, nbytes: int) -> int:
        return -(-nbytes // self.alignment) * self.alignment

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a newly allocated range of ``nbytes`` (rounded up), or None if none fits."""
        need = self.round(nbytes)
        exact = self._by_length.get(need)
        if exact:
            offset = next(iter(exact))
            self._take(offset)
            return offset
        for offset in self._starts:
            length = self._length[offset]
            if length >= need:
                self._take(offset)
                self._put(offset + need, length - need)
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return a range obtained from :meth:`allocate` (with the same ``nbytes``)."""
        length = self.round(nbytes)
        following = self._length.get(offset + length)
        if following is not None:
            self._take(offset + length)
            length += following
        index = bisect.bisect_left(self._starts, offset)
        if index > 0:
            before = self._starts[index - 1]
            if before + self._length[before] == offset:
                length += self._length[before]
                self._take(before)
                offset = before
        self._put(offset, length)

    def largest_free(self) -> int:
        return max(self._length.values(), default=0)

    # ----------------------------------------------------------------- bookkeeping

    def _take(self, offset: int) -> None:
        length = self._length.pop(offset)
        del self._starts[bisect.bisect_left(self._starts, offset)]
        bucket = self._by_length[length]
        bucket.discard(offset)
        if not bucket:
            del self._by_length[length]
        self.free_bytes -= length

    def _put(self, offset: int, length: int) -> None:
        if length <= 0:
            return
        bisect.insort(self._starts, offset)
        self._length[offset] = length
        self._by_length.setdefault(length, set()).add(offset)
        self.free_bytes += length
