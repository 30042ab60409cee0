"""The cache operations: register, lookup, store/commit, retrieve/release, request ends.

:class:`CacheService` assembles them (``_service``) over :class:`~._io.CacheIO` (sessions,
turns, the L2 tier, loads) over the I/O-free :class:`~._core.CacheCore` (the tables and every
step on them; it imports neither trio nor ZeroMQ, and is driven directly by
``tests/server/cache/``). Each operation's module holds one concern (see ``docs/design.md``,
"The server's folders"). The worker-facing copy work goes through the registration's copy
path (``_copy``): the host path or the CUDA path, chosen once at registration. The names below
are loaded on first use (importing the core loads no I/O library).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_getattr

if TYPE_CHECKING:
    from ._cuda import CudaTransfers, RuntimeFactory
    from ._service import CacheService

__all__ = ["CacheService", "CudaTransfers", "RuntimeFactory"]

_WHERE = {"CacheService": "._service", "CudaTransfers": "._cuda", "RuntimeFactory": "._cuda"}


__getattr__ = lazy_getattr(__name__, _WHERE)
