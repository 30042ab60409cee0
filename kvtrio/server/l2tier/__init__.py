"""The L2 tier inside the server: write-behind, lookups across the backend cascade, L2→L1 loads.

:func:`open_l2_tier` makes the :class:`L2Tier`, which holds the backends and runs the tier's
tasks in a nursery of its own; the cache operations use its parts
directly: write-behind (:class:`WriteBehind`), lookups and loads (:class:`Loads`), L1 hits passed
on to the backends' policies (:class:`Touches`). The backends' health and the one boundary for
calls into them are in ``_backends``. The backends themselves (``kvtrio.l2``) only move bytes;
framing and verification happen here.
"""

from ._admission import Admission
from ._backends import Observe, TierBackend, TierListener
from ._loads import Load, Loads
from ._tier import L2Tier, open_l2_tier
from ._touches import Touches
from ._writes import WriteBehind

__all__ = [
    "Admission",
    "L2Tier",
    "Load",
    "Loads",
    "Observe",
    "TierBackend",
    "TierListener",
    "Touches",
    "WriteBehind",
    "open_l2_tier",
]
