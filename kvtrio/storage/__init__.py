"""Where chunks live: keys, the L1 index of the shared arena, eviction policies and leases.

Synchronous and free of I/O; the server drives it from its event loop. The arena itself (the
shared-memory file) is :mod:`kvtrio.shm`.
"""

from ._allocator import ExtentAllocator
from ._eviction import LRU, EvictionPolicy
from ._l1 import Entry, EntryState, L1Cache, L1Listener, L1Stats, Reservation
from ._leases import Lease, LeaseKind, LeaseTable
from ._policies import DEFAULT_EVICTION, EVICTION_POLICIES, make_policy
from .keys import (
    HASH_SCHEME_TOKENS,
    KEY_SIZE,
    ModelProfile,
    block_chunk_hashes,
    block_hash_scheme,
    namespace,
    object_key,
    token_chunk_hashes,
)

__all__ = [
    "DEFAULT_EVICTION",
    "EVICTION_POLICIES",
    "HASH_SCHEME_TOKENS",
    "KEY_SIZE",
    "LRU",
    "Entry",
    "EntryState",
    "EvictionPolicy",
    "ExtentAllocator",
    "L1Cache",
    "L1Listener",
    "L1Stats",
    "Lease",
    "LeaseKind",
    "LeaseTable",
    "ModelProfile",
    "Reservation",
    "block_chunk_hashes",
    "block_hash_scheme",
    "make_policy",
    "namespace",
    "object_key",
    "token_chunk_hashes",
]
