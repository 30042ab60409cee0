"""The cache operations: register, lookup, store/commit, retrieve/release, request ends.

:class:`CacheService` assembles them over one :class:`~._core.CacheCore` (the tables and the
steps the operations share) and installs their handlers; each operation's module holds one
concern (see ``docs/design.md``, "The server's folders"). The worker-facing copy work goes
through the registration's copy path (``_copy``): the host path or the CUDA path, chosen once
at registration.
"""

from ._cuda import CudaTransfers, RuntimeFactory
from ._service import CacheService

__all__ = ["CacheService", "CudaTransfers", "RuntimeFactory"]
