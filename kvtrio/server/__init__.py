"""The kvtrio server: router, sessions and operation handlers under one root nursery.

The names below are loaded on first use, so that importing one of the server's I/O-free parts
(the cache core, ``kvtrio.server.cache._core``) loads neither trio nor ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_getattr

if TYPE_CHECKING:
    from ._metrics import ServerMetrics
    from ._serve import ServerHandle, open_server, serve
    from ._session import Session
    from ._state import Operation, ServerState
    from ._status import describe_storage, status_document, status_summary, storage_summary

__all__ = [
    "Operation",
    "ServerHandle",
    "ServerMetrics",
    "ServerState",
    "Session",
    "describe_storage",
    "open_server",
    "serve",
    "status_document",
    "status_summary",
    "storage_summary",
]

_WHERE = {
    "ServerMetrics": "._metrics",
    "ServerHandle": "._serve",
    "open_server": "._serve",
    "serve": "._serve",
    "Session": "._session",
    "Operation": "._state",
    "ServerState": "._state",
    "describe_storage": "._status",
    "status_document": "._status",
    "status_summary": "._status",
    "storage_summary": "._status",
}


__getattr__ = lazy_getattr(__name__, _WHERE)
