"""Admission to L2 by predicted reuse: which committed chunks are worth writing to the backends.

Writing every chunk costs the backends' bandwidth (and an SSD's endurance) for chunks nobody
reads again: with no reuse at all, every L2 write is wasted. With ``--l2-admission reuse`` a
committed chunk is written only if it is likely to be read again:

- **seen before**: at least :data:`THRESHOLD` lookups of distinct requests asked for it (the
  committing request's own lookup is one; an L1 hit never needs counting, see below), counted
  by :class:`ReuseSketch`, a TinyLFU-style estimate (a doorkeeper bit set for keys seen once, a
  count-min sketch of 4-bit counters for keys seen again, all halved every
  :data:`SAMPLE` counts: bounded memory, old popularity fades);
- **the continuation of a reused prefix** (a conversation's history, what follows a shared
  system prompt): its parent was seen before, or was admitted itself (a bit set of admitted
  keys, cleared with the halving), so a conversation's turn writes its whole new tail once its
  prefix proved reused;
- **seen once, while such chunks come back**: while at least 1 in :data:`RETURNS` of the chunks
  lookups missed in L1 for the first time comes back to a later lookup (found in L1 after a
  refusal, or missed there again: L1 dropped it, and only L2 could have served it; a workload
  of pairs, say, a prompt asked twice an hour apart), a chunk seen once is written too: it
  cannot be told apart from those at its commit, and a load from L2 costs far less than
  recomputing it. The share is a windowed estimate that forgets: its two counts (first
  sightings, returns) are halved every :data:`WINDOW` first sightings, and the returns never
  count for more than the first sightings, so after a switch to a workload with no reuse it
  falls below 1 in :data:`RETURNS` within :data:`FORGET` first sightings (and the L2 writes of
  chunks seen once stop). With no reuse at all nothing comes back, and nothing seen once is
  written. Meanwhile the chunks refused before are caught up
  with, :data:`BACKLOG` per commit, oldest first (:meth:`Admission.backlog`).

A chunk refused at its commit is remembered (:data:`REFUSED` at most, the oldest forgotten)
and **admitted later** when it is used again while still in L1 (:meth:`Admission.used`: a
lookup hit it, or a store found it there): a chunk that proves reused reaches L2 before L1
can evict it. Admitting a chunk admits its refused ancestors first, so L2 never holds a chunk
whose parent is missing there only because admission refused it (a lookup walks prefixes).

``all`` writes every chunk (the behaviour before admission). ``auto`` (the default) is
``reuse`` unless a backend is a shared store (``redis``, ``s3``): there the other servers'
lookups, which this server does not see, are what the L2 is for.

Synchronous, no I/O, O(1) per key: the write-behind (``_writes``) and the lookups call it from
the event loop.
"""

from __future__ import annotations

import collections
import hashlib
import logging
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

from ..._logging import event

__all__ = [
    "BACKLOG",
    "FORGET",
    "REFUSED",
    "RETURNS",
    "SAMPLE",
    "THRESHOLD",
    "WINDOW",
    "Admission",
    "ReuseSketch",
]

log = logging.getLogger("kvtrio.l2")

THRESHOLD = 2
"""Distinct requests that must have looked a chunk up for it to count as seen before."""
RETURNS = 50
"""Chunks seen once are written while at least 1 in this many of the chunks lookups missed
in L1 for the first time came back (see the module docstring)."""
BACKLOG = 2
"""Refused chunks admitted per commit while chunks seen once are (see the module docstring)."""
_MIN_FIRST = 256
"""First sightings needed before the share that came back is trusted (until then: refused)."""
WINDOW = 1024
"""First sightings between two halvings of the return-rate counts (:attr:`Admission.returning`)."""
FORGET = 8 * WINDOW
"""First sightings after which a workload with no reuse has switched chunks seen once off,
whatever came back before: the returns, at most the first sightings (at most 2 × WINDOW), are
halved every WINDOW, 7 times below 1 in RETURNS of the WINDOW or more first sightings."""
SAMPLE = 1 << 17
"""Counts between two halvings of the sketch (and resets of its bit sets)."""
REFUSED = 65536
"""Refused chunks remembered, to be admitted when used again from L1."""
_RECENT_REQUESTS = 4096
"""Requests whose lookup was counted, remembered so that a repeated lookup counts once."""
_SUMMARY_INTERVAL = 60.0
"""Seconds between two DEBUG summaries of the admission counters."""

_ROWS = 3
_ROW_BITS = 18  # 3 rows of 2^18 one-byte counters: 768 KiB (bits 0-53 of a key's mix)
_SET_BITS = 22  # each bit set: 2^22 bits, 512 KiB, 3 probes (bits 54-119 of a key's mix):
# 0.07 % false positives at SAMPLE keys, 0.0002 % at 16k
_HALVE = bytes(i >> 1 for i in range(256))
_MAX_COUNT = 15

T = TypeVar("T")


def _mix(key: bytes) -> int:
    """128 well-mixed bits of a key. An object key (namespace ‖ chunk hash, both digests) has
    its halves folded, so that one prompt's chunks in two namespaces count apart; a shorter key
    (tests, the simulator) is hashed."""
    if len(key) < 32:
        key = hashlib.blake2b(key, digest_size=32).digest()
    return int.from_bytes(key[16:32], "little") ^ (int.from_bytes(key[:16], "little") * 0x9E3779B1)


class _BitSet:
    """A Bloom filter of three probes over ``2**bits`` bits (no I/O; cleared whole)."""

    def __init__(self, bits: int) -> None:
        self._mask = (1 << bits) - 1
        self._shifts = (_ROWS * _ROW_BITS, _ROWS * _ROW_BITS + bits, _ROWS * _ROW_BITS + 2 * bits)
        self._data = bytearray(1 << (bits - 3))

    def __contains__(self, mixed: int) -> bool:
        data, mask = self._data, self._mask
        for shift in self._shifts:
            bit = (mixed >> shift) & mask
            if not data[bit >> 3] & (1 << (bit & 7)):
                return False
        return True

    def add(self, mixed: int) -> None:
        data, mask = self._data, self._mask
        for shift in self._shifts:
            bit = (mixed >> shift) & mask
            data[bit >> 3] |= 1 << (bit & 7)

    def clear(self) -> None:
        self._data = bytearray(len(self._data))


class ReuseSketch:
    """A TinyLFU-style estimate of how often each key was counted recently.

    The first count of a key sets its bits in the doorkeeper; later counts go to a count-min
    sketch (:data:`_ROWS` rows of saturating 4-bit counters, the minimum over the rows is the
    estimate). Every ``sample`` counts the counters are halved and the doorkeeper cleared.
    :meth:`estimate` is ``sketch + doorkeeper``: 0 for a key never counted, 1 for one counted
    once, more for keys counted again (never less than the count since the last halving plus
    half the count before it, and so on; more only through collisions).
    """

    def __init__(self, sample: int = SAMPLE, row_bits: int = _ROW_BITS) -> None:
        self._sample = sample
        self._row_bits = row_bits
        self._width = 1 << row_bits
        self._counters = bytearray(_ROWS << row_bits)
        self.doorkeeper = _BitSet(_SET_BITS)
        self.counted = 0
        """Counts since the last halving."""
        self.halvings = 0
        self.first = 0
        """Keys counted that had not been counted since the last halving (halved with it)."""
        self.again = 0
        """Keys counted that had been counted before (halved with it)."""

    def _cells(self, mixed: int) -> list[int]:
        width, mask = self._width, self._width - 1
        return [row * width + ((mixed >> (row * self._row_bits)) & mask) for row in range(_ROWS)]

    def add(self, key: bytes) -> None:
        """Count ``key`` once."""
        self.add_mixed(_mix(key))

    def add_mixed(self, mixed: int) -> bool:
        """Count a mixed key once; whether it was a first sighting (not counted since the last
        halving)."""
        first = mixed not in self.doorkeeper
        if first:
            self.doorkeeper.add(mixed)
            self.first += 1
        else:
            self.again += 1
            counters = self._counters
            for cell in self._cells(mixed):
                if counters[cell] < _MAX_COUNT:
                    counters[cell] += 1
        self.counted += 1
        if self.counted >= self._sample:
            self.halve()
        return first

    def estimate(self, key: bytes) -> int:
        """How often ``key`` was counted recently (see the class docstring)."""
        return self.estimate_mixed(_mix(key))

    def estimate_mixed(self, mixed: int) -> int:
        counters = self._counters
        counted = min(counters[cell] for cell in self._cells(mixed))
        return counted + 1 if mixed in self.doorkeeper else counted

    def halve(self) -> None:
        """Halve every counter and clear the doorkeeper (the periodic aging)."""
        self._counters = bytearray(self._counters.translate(_HALVE))
        self.doorkeeper.clear()
        self.first //= 2
        self.again //= 2
        self.counted = 0
        self.halvings += 1


class Admission(Generic[T]):
    """The admission decisions of one L2 tier (see the module docstring) and their counters.

    ``T`` is what the caller needs to write a refused chunk later (the write-behind's
    fingerprint and tenant); it is kept with the refused key and handed back by :meth:`used`.
    """

    def __init__(self, mode: str = "all", *, refused: int = REFUSED, sample: int = SAMPLE) -> None:
        if mode not in ("all", "reuse"):
            raise ValueError(f"admission mode must be 'all' or 'reuse', got {mode!r}")
        self.mode = mode
        self.sketch = ReuseSketch(sample)
        self._admitted_keys = _BitSet(_SET_BITS)
        self._halvings = 0
        self._refused: collections.OrderedDict[bytes, tuple[bytes | None, T]] = (
            collections.OrderedDict()
        )
        self._limit = refused
        self._recent: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self.admitted = 0
        """Chunks admitted at their commit (all of them with ``all``)."""
        self.refused = 0
        """Chunks refused at their commit."""
        self.admitted_later = 0
        """Refused chunks admitted later, when used again from L1."""
        self._first = 0
        """First sightings counted, halved every :data:`WINDOW` of them: see :attr:`returning`."""
        self._back = 0
        """Chunks that came back (counted again, or refused and used again from L1), halved
        with :attr:`_first` and never above it."""
        self._window = 0
        """First sightings since the last halving of the two."""
        self._logged_refusal = False
        self._summary_at = -1.0

    @property
    def counting(self) -> bool:
        """Whether lookups are counted (only ``reuse`` decides anything by them)."""
        return self.mode == "reuse"

    @property
    def waiting(self) -> int:
        """Refused chunks remembered now."""
        return len(self._refused)

    def first_lookup(self, request: Hashable) -> bool:
        """Whether the keys of this lookup of ``request`` are to be counted (:meth:`count`):
        with ``reuse``, unless ``request`` was looked up already (the last
        :data:`_RECENT_REQUESTS` requests are remembered), so that a request counts once."""
        if not self.counting:
            return False
        recent = self._recent
        if request in recent:
            recent.move_to_end(request)
            return False
        recent[request] = None
        if len(recent) > _RECENT_REQUESTS:
            recent.popitem(last=False)
        return True

    def count(self, keys: Iterable[bytes]) -> None:
        """A lookup asked for ``keys`` beyond its L1 prefix (see :meth:`first_lookup`): count
        each once. Chunks found in L1 need no count: a hit admits them (:meth:`used`); a key
        counted before is one that came back after L1 dropped it (see :attr:`returning`)."""
        add = self.sketch.add_mixed
        firsts = backs = 0
        for key in keys:
            if add(_mix(key)):
                firsts += 1
            else:
                backs += 1
        if backs:
            self._came_back(backs)
        if firsts:
            self._first += firsts
            self._window += firsts
            while self._window >= WINDOW:
                self._window -= WINDOW
                self._first //= 2
                self._back //= 2

    def _came_back(self, count: int) -> None:
        """``count`` chunks came back: they count, up to the first sightings."""
        self._back = min(self._first, self._back + count)

    def commit(self, key: bytes, parent: bytes | None, value: T, now: float = 0.0) -> bool:
        """``key`` was committed to L1 (``parent``: the chunk before it): whether to write it
        now. A refused chunk is remembered with ``value`` until it is used again
        (:meth:`used`) or forgotten. ``now`` (seconds) paces the DEBUG summary."""
        if self.mode == "all":
            self.admitted += 1
            return True
        self._age()
        mixed = _mix(key)
        if (
            self.sketch.estimate_mixed(mixed) >= THRESHOLD
            or (parent is not None and self._hot(parent))
            or self.returning
        ):
            self.admitted += 1
            self._admitted_keys.add(mixed)
            self._refused.pop(key, None)
            return True
        self.refused += 1
        self._refused[key] = (parent, value)
        self._refused.move_to_end(key)
        if len(self._refused) > self._limit:
            self._refused.popitem(last=False)
        self._log(now)
        return False

    def used(self, keys: Iterable[bytes]) -> list[tuple[bytes, T]]:
        """``keys`` (in prompt order) were used again from L1 (a lookup hit, a store found them
        there): those refused are admitted now, each after its refused ancestors. Returns
        ``(key, value)`` to write, parents first; the caller checks they are still in L1."""
        if not self._refused:
            return []
        out: list[tuple[bytes, T]] = []
        for key in keys:
            remembered = self._refused.pop(key, None)
            if remembered is None:
                continue
            chain = [(key, remembered)]
            parent = remembered[0]
            while parent is not None and len(chain) <= self._limit:
                older = self._refused.pop(parent, None)
                if older is None:
                    break
                chain.append((parent, older))
                parent = older[0]
            for chunk, (_, value) in reversed(chain):
                self.admitted_later += 1
                self._came_back(1)
                self._admitted_keys.add(_mix(chunk))
                out.append((chunk, value))
        return out

    @property
    def returning(self) -> bool:
        """Whether chunks seen once come back after L1 dropped them often enough (1 in
        :data:`RETURNS`) that writing them pays, in the recent first sightings (halved every
        :data:`WINDOW`: see the module docstring)."""
        first = self._first
        return first >= _MIN_FIRST and self._back * RETURNS >= first

    def backlog(self) -> list[tuple[bytes, T]]:
        """While chunks seen once are written (:attr:`returning`), the :data:`BACKLOG` oldest
        refused ones, now admitted (``(key, value)``; the caller checks they are still in
        L1); else nothing. Called after each commit."""
        if not self._refused or not self.returning:
            return []
        out = []
        for _ in range(min(BACKLOG, len(self._refused))):
            chunk, (_, value) = self._refused.popitem(last=False)
            self.admitted_later += 1
            self._admitted_keys.add(_mix(chunk))
            out.append((chunk, value))
        return out

    def _hot(self, parent: bytes) -> bool:
        """Whether a chunk after ``parent`` continues a reused prefix."""
        mixed = _mix(parent)
        return mixed in self._admitted_keys or self.sketch.estimate_mixed(mixed) >= THRESHOLD

    def _age(self) -> None:
        """Clear the admitted keys with the sketch's halving (their lineage fades too)."""
        if self.sketch.halvings != self._halvings:
            self._halvings = self.sketch.halvings
            self._admitted_keys.clear()

    def _log(self, now: float) -> None:
        """One INFO line at the first refusal; then a DEBUG summary at most every
        :data:`_SUMMARY_INTERVAL` seconds."""
        if not self._logged_refusal:
            self._logged_refusal = True
            self._summary_at = now
            log.info(
                "L2 admission: a chunk seen once was not written to L2 (l2_admission=reuse; "
                "it is written if used again while in L1; l2_admission=all writes every chunk)",
                extra=event("l2_admission_refused"),
            )
            return
        if now - self._summary_at >= _SUMMARY_INTERVAL:
            self._summary_at = now
            log.debug(
                "L2 admission: %d chunks admitted, %d refused, %d admitted later",
                self.admitted,
                self.refused,
                self.admitted_later,
                extra=event(
                    "l2_admission",
                    admitted=self.admitted,
                    refused=self.refused,
                    admitted_later=self.admitted_later,
                ),
            )
