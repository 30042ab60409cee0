"""State shared by the server's tasks: settings, counters, the operation table, live sessions."""

from __future__ import annotations

import collections
import os
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import trio

from .._version import __version__
from ..config import ServerConfig, config_summary
from ..errors import ErrorCode
from ..protocol import CacheStats, L2Stats, Reply, Request, ServerCounters, StatsReply
from ._auth import ServerAuth
from ._status import storage_summary

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["Counters", "Handler", "Operation", "ServerState"]

_R = TypeVar("_R", bound=Request)
Handler = Callable[["Session", Any], Awaitable[Reply]]
"""``async def handler(session, request) -> reply``; raise ``RequestError`` to answer an error."""


@attrs.frozen
class Operation:
    """How the server runs one operation."""

    handler: Handler
    concurrent: bool = False
    """Run as a child task of the session (replies may overtake earlier requests' replies)."""


@attrs.define
class Counters:
    """Monotonic server counters (see ``ServerCounters`` in the protocol for their meaning)."""

    requests: int = 0
    errors: int = 0
    errors_by_code: collections.Counter[str] = attrs.field(factory=collections.Counter)
    frames_dropped: int = 0
    replies_undeliverable: int = 0
    sessions_started: int = 0
    sessions_ended: int = 0
    sessions_expired: int = 0
    sessions_refused: int = 0
    """New sessions refused at a session limit (``max_sessions``, ``max_sessions_per_key``)."""

    def error(self, code: ErrorCode) -> None:
        self.errors += 1
        self.errors_by_code[code.value] += 1


class ServerState:
    """Everything the router, the sessions and the handlers share. One per ``serve`` call."""

    def __init__(self, config: ServerConfig, endpoint: str, auth: ServerAuth | None = None) -> None:
        self.config = config
        self.auth = auth or ServerAuth("ipc" if endpoint.startswith("ipc://") else "insecure")
        """Who clients are and how many sessions they may hold (see ``_auth``)."""
        self.session_id_key = os.urandom(16)
        """Keys the session ids shown in stats and logs: they never reveal a routing id."""
        self.endpoint = endpoint
        """The endpoint actually bound (a tcp port of 0 resolved)."""
        self.instance_id = uuid.uuid4().hex
        self.started_at = trio.current_time()
        self.counters = Counters()
        self.sessions: dict[bytes, Session] = {}
        self.operations: dict[type[Request], Operation] = {}
        self.cache_stats: Callable[[], CacheStats] | None = None
        """Set by the cache service: its part of the ``stats`` reply."""
        self.l2_stats: Callable[[], tuple[L2Stats, ...]] | None = None
        self.draining = False
        self.serving = False
        """True once the router takes requests (``/healthz`` answers 200 while not draining)."""
        self.observe_request: Callable[[str, ErrorCode | None, float], None] | None = None
        """Set by the metrics: ``(operation, error code or None, seconds)`` per answered request."""
        self.pending = 0
        """Requests accepted by the router that have not been answered (or dropped) yet."""
        self._idle = trio.Event()

    def register(
        self,
        request_type: type[_R],
        handler: Callable[[Session, _R], Awaitable[Reply]],
        *,
        concurrent: bool = False,
    ) -> None:
        """Declare the handler of ``request_type`` (one per type; later registrations replace)."""
        self.operations[request_type] = Operation(handler, concurrent)

    @property
    def phase(self) -> str:
        """``starting``, ``serving`` or ``draining``."""
        if self.draining:
            return "draining"
        return "serving" if self.serving else "starting"

    # ----------------------------------------------------------------- drain accounting

    def accepted(self) -> None:
        self.pending += 1

    def settled(self, count: int = 1) -> None:
        self.pending -= count
        if self.pending == 0 and self.draining:
            self._idle.set()

    async def wait_drained(self) -> None:
        """Return once draining and no accepted request is waiting for its reply."""
        if self.pending == 0:
            return
        await self._idle.wait()

    # ----------------------------------------------------------------- stats

    def stats(self) -> StatsReply:
        now = trio.current_time()
        c = self.counters
        return StatsReply(
            server_version=__version__,
            instance_id=self.instance_id,
            uptime_seconds=now - self.started_at,
            phase=self.phase,
            config={**config_summary(self.config), "storage": storage_summary(self.config)},
            counters=ServerCounters(
                requests=c.requests,
                errors=c.errors,
                errors_by_code=dict(c.errors_by_code),
                frames_dropped=c.frames_dropped,
                replies_undeliverable=c.replies_undeliverable,
                sessions_started=c.sessions_started,
                sessions_ended=c.sessions_ended,
                sessions_expired=c.sessions_expired,
            ),
            sessions=tuple(session.stats(now) for session in self.sessions.values()),
            cache=self.cache_stats() if self.cache_stats is not None else None,
            l2=self.l2_stats() if self.l2_stats is not None else (),
        )
