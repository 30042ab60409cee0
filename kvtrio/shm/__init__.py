"""The L1 arena: the shared-memory file the server creates and its CPU workers map.

One home for what both sides of the copy use: the server (which hands out byte ranges of the
arena as slots) and the worker adapter (which copies between its engine's tensors and those
slots). It imports nothing of kvtrio, so every layer above may use it; the server's index of
what lives where in the arena is in :mod:`kvtrio.storage`.
"""

from ._arena import SharedArena, default_shm_dir, populate_pages, reclaim_stale_arenas

__all__ = ["SharedArena", "default_shm_dir", "populate_pages", "reclaim_stale_arenas"]
