"""Where chunks live: keys, the shared L1 arena, its index, eviction policies and leases.

Synchronous and free of I/O except for mapping the arena; the server drives it from its event
loop.
"""

from ._allocator import ExtentAllocator
from ._arena import SharedArena, default_shm_dir, reclaim_stale_arenas
from ._eviction import LRU, EvictionPolicy
from ._l1 import Entry, EntryState, L1Cache, L1Stats, Reservation
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
    "L1Stats",
    "Lease",
    "LeaseKind",
    "LeaseTable",
    "ModelProfile",
    "Reservation",
    "SharedArena",
    "block_chunk_hashes",
    "block_hash_scheme",
    "default_shm_dir",
    "make_policy",
    "namespace",
    "object_key",
    "reclaim_stale_arenas",
    "token_chunk_hashes",
]
