"""What the cache core (``_core``) takes and gives: its callers, and its answers as data (a
lookup's start and first step, a commit's chunks for the L2 write-behind). No I/O."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

from ._keys import RequestKey
from ._registry import ModelEntry

__all__ = ["Caller", "Client", "L2Write", "LookupStart", "LookupStep"]


class Caller(Protocol):
    """Who asks: a session's id (the owner of its leases) and its client key (``""``: none)."""

    @property
    def id(self) -> str: ...

    @property
    def user(self) -> str: ...


@attrs.frozen
class Client:
    """A :class:`Caller` that is not a server session (tests, tools)."""

    id: str
    user: str = ""


@attrs.frozen
class L2Write:
    """A committed chunk for the L2 write-behind."""

    key: bytes
    fingerprint: bytes
    tenant: str


@attrs.frozen
class LookupStart:
    """A lookup checked and admitted, the pins of its request's previous lookup released: its
    loads must be cancelled before :meth:`CacheCore.pin_first`."""

    request: RequestKey
    model: ModelEntry
    hashes: Sequence[bytes]
    keys: int
    """Object keys the lookup names (its share of the key budget while it goes on)."""


@attrs.frozen
class LookupStep:
    """A lookup after its first step: the L1 prefix of its first slice pinned (``hit``), and
    what is left: more L1 slices (``more``), then, if ``l2``, the chunks from ``hashes[found:]``
    are needed from L2 by ``deadline``."""

    request: RequestKey
    model: ModelEntry
    hashes: Sequence[bytes]
    hit: int
    readers: int
    expires: float
    keys: int
    """Object keys the lookup names (its share of the key budget while it goes on)."""
    more: bool
    l2: bool
    deadline: float

    @property
    def done(self) -> bool:
        """Answered from L1 now: no more slices, nothing to ask L2."""
        return not (self.more or self.l2)
