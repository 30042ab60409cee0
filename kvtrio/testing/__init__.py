"""Test helpers for backend authors and kvtrio's own tests.

- :class:`BackendConformance`: the L2 conformance suite (needs pytest and pytest-trio);
- :class:`FakeCuda`: a simulated CUDA runtime (GPUs, IPC, streams, events) for testing the CUDA
  transfer path without a GPU;
- :class:`FaultBackend`: an L2 backend that wraps another and injects latency, errors and
  dropped loads (a test backend: not installed under the ``kvtrio.backends`` entry points;
  ``kvtrio.l2.register("fault", FaultBackend)`` makes it usable by name).

The real Redis/Valkey and SeaweedFS servers the tests start are test support in the source tree
(``tests/_support/redis_servers.py``, ``tests/_support/seaweedfs.py``), not in this package.
"""

from ._conformance import BackendConformance
from ._fake_cuda import FakeCuda, FakeEvent, FakeStream, FakeTensor
from ._fault import FaultBackend, FaultOptions

__all__ = [
    "BackendConformance",
    "FakeCuda",
    "FakeEvent",
    "FakeStream",
    "FakeTensor",
    "FaultBackend",
    "FaultOptions",
]
