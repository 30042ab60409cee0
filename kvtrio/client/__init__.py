"""Clients of a kvtrio server.

:func:`open_client` for trio code, :class:`Client` for threads, and the engine adapters
:class:`SchedulerAdapter` / :class:`WorkerAdapter` built on it.
"""

from ..protocol import chunk_hashes
from ._async import AsyncClient, open_client
from ._common import curve_options
from ._copies import EventGroup, LoadStoreOp
from ._events import EventIndex, subscribe
from ._identity import EngineIdentity
from ._placement import ThreadPlacement
from ._relay import EventRelay
from ._scheduler import SchedulerAdapter
from ._sync import Client
from ._waiting import connect_waiting
from ._worker import WorkerAdapter

__all__ = [
    "AsyncClient",
    "Client",
    "EngineIdentity",
    "EventGroup",
    "EventIndex",
    "EventRelay",
    "LoadStoreOp",
    "SchedulerAdapter",
    "ThreadPlacement",
    "WorkerAdapter",
    "chunk_hashes",
    "connect_waiting",
    "curve_options",
    "open_client",
    "subscribe",
]
