"""The L2 tier inside the server: write-behind, lookups across the backend cascade, L2→L1 loads.

:class:`L2Tier` is what the cache operations use; its parts are write-behind (``_writes``),
lookups and loads (``_loads``), L1 hits passed on to the backends' policies (``_touches``), and
the backends' health with the one boundary for calls into them (``_backends``). The backends
themselves (``kvtrio.l2``) only move bytes; framing and verification happen here.
"""

from ._backends import Observe, TierBackend
from ._loads import Load
from ._tier import L2Tier

__all__ = ["L2Tier", "Load", "Observe", "TierBackend"]
