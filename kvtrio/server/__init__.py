"""The kvtrio server: router, sessions and operation handlers under one root nursery."""

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
