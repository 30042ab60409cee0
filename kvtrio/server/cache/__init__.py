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

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._cuda import CudaTransfers, RuntimeFactory
    from ._service import CacheService

__all__ = ["CacheService", "CudaTransfers", "RuntimeFactory"]

_WHERE = {"CacheService": "._service", "CudaTransfers": "._cuda", "RuntimeFactory": "._cuda"}


def __getattr__(name: str) -> Any:
    """Load a public name from its module the first time it is asked for."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value
