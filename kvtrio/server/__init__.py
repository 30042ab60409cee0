"""The kvtrio server: router, sessions and operation handlers under one root nursery."""

from ._serve import ServerHandle, open_server, serve
from ._session import Session
from ._state import Operation, ServerState

__all__ = ["Operation", "ServerHandle", "ServerState", "Session", "open_server", "serve"]
