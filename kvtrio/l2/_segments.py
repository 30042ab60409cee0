"""The disk backend's segment bookkeeping: where records go, and what space to give back.

Pure state, no I/O (the backend runs the frees it hands out in worker threads). Synchronous:
the backend calls it between checkpoints, so no two tasks ever see it half-updated.
"""

from __future__ import annotations

import collections

import attrs

from ._diskrecord import record_size

__all__ = ["Frees", "Location", "Segments"]

Location = tuple[int, int, int]
"""Where an object is: (segment number, offset of its record, object length)."""


@attrs.define
class Frees:
    """Space to give back: record ranges to punch, segment files to unlink."""

    punches: list[Location] = attrs.field(factory=list)
    unlinks: list[int] = attrs.field(factory=list)

    def __bool__(self) -> bool:
        return bool(self.punches or self.unlinks)


class Segments:
    """Records are appended to one *active* segment until it holds ``segment_size`` bytes
    (a record larger than that gets a segment of its own). Each segment counts its records not
    given back yet (being written included); giving back its last one unlinks it, unless it is
    the active one (then it goes when the next segment starts). A range being read is given
    back only after its last read."""

    def __init__(self, segment_size: int) -> None:
        self.segment_size = segment_size
        self._refs: dict[int, int] = {}  # segment → records not given back yet
        self._active: int | None = None
        self._end = 0  # where the active segment's next record goes
        self._next = 0  # the next segment's number
        self._reading: collections.Counter[tuple[int, int]] = collections.Counter()
        self._deferred: dict[tuple[int, int], Location] = {}  # given back while being read
        self._frees = Frees()

    def __len__(self) -> int:
        """Segment files (existing, or about to be created by a write)."""
        return len(self._refs)

    def scanned(self, segment: int, records: int) -> None:
        """A segment found by the scan (in increasing order) with that many records; new
        records go to new segments after it."""
        self._refs[segment] = records
        self._next = max(self._next, segment + 1)

    def allocate(self, length: int) -> Location:
        """A range for the record of an object of ``length`` bytes: after the previous one in
        the active segment, or at the start of a new segment."""
        size = record_size(length)
        if self._active is None or (self._end and self._end + size > self.segment_size):
            if self._active is not None and not self._refs[self._active]:
                del self._refs[self._active]  # (emptied while it was active)
                self._frees.unlinks.append(self._active)
            self._active, self._end = self._next, 0
            self._next += 1
            self._refs[self._active] = 0
        location = (self._active, self._end, length)
        self._end += size
        self._refs[self._active] += 1
        return location

    def release(self, location: Location) -> None:
        """Give a record's range back (see :meth:`take_frees`), or after its last read."""
        segment, offset, _ = location
        if self._reading[(segment, offset)]:
            self._deferred[(segment, offset)] = location
            return
        refs = self._refs[segment] - 1
        if refs or segment == self._active:
            self._refs[segment] = refs
            self._frees.punches.append(location)
        else:
            del self._refs[segment]
            self._frees.unlinks.append(segment)

    def start_reading(self, location: Location) -> None:
        self._reading[location[:2]] += 1

    def done_reading(self, location: Location) -> None:
        """The read of ``location`` ended: if it was given back meanwhile, release it now."""
        key = location[:2]
        self._reading[key] -= 1
        if self._reading[key] > 0:
            return
        del self._reading[key]
        deferred = self._deferred.pop(key, None)
        if deferred is not None:
            self.release(deferred)

    def take_frees(self) -> Frees | None:
        """What to punch and unlink now (each handed out once), or None if nothing."""
        if not self._frees:
            return None
        frees, self._frees = self._frees, Frees()
        return frees
