"""The eviction policies by name, for ``--eviction NAME`` (L1) and the L2 tiers' ``eviction=``.

Each factory takes no argument and returns a fresh :class:`~._eviction.EvictionPolicy`.
"""

from __future__ import annotations

from collections.abc import Callable

from ._arc import ARC
from ._eviction import LRU, EvictionPolicy
from ._plru import PrefixLRU
from ._reuse import ReusePolicy
from ._s3fifo import S3FIFO
from ._sieve import Sieve

__all__ = ["DEFAULT_EVICTION", "EVICTION_POLICIES", "make_policy"]

EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRU,
    "arc": ARC,
    "plru": PrefixLRU,
    "s3fifo": S3FIFO,
    "sieve": Sieve,
    "reuse": ReusePolicy,
}
"""name → factory. ``lru`` is plain LRU, blind to prefixes, kept for comparison."""

DEFAULT_EVICTION = "arc"
"""Chosen with the offline evaluator (``bench/eviction.py``); see docs/design.md."""


def make_policy(name: str) -> EvictionPolicy:
    """A new policy of that name; ``ValueError`` naming the known ones otherwise."""
    try:
        factory = EVICTION_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"unknown eviction policy {name!r} (known: {known})") from None
    return factory()
