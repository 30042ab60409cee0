"""The tagged union of requests: operation name → request class."""

from __future__ import annotations

from ._cache import CACHE_REQUEST_TYPES
from ._messages import CORE_REQUEST_TYPES, Request

__all__ = ["OPERATIONS", "REQUEST_TYPES"]

REQUEST_TYPES: tuple[type[Request], ...] = CORE_REQUEST_TYPES + CACHE_REQUEST_TYPES
OPERATIONS: dict[str, type[Request]] = {cls.op: cls for cls in REQUEST_TYPES}
"""Operation name → request class: the tagged union the codec decodes requests with."""
