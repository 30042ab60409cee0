"""State shared by the server's tasks: settings, counters, the operation table, live sessions."""

from __future__ import annotations

import collections
import os
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import attrs
import trio

from .._version import __version__
from ..config import ServerConfig, config_summary
from ..errors import ErrorCode
from ..protocol import (
    CacheStats,
    L2Stats,
    Reply,
    Request,
    ServerCounters,
    SessionStats,
    StatsReply,
)
from ..transport import ANY_TENANT
from ._auth import Principal, ServerAuth
from ._events import EventPublisher
from ._heartbeats import Heartbeats
from ._status import storage_summary

__all__ = [
    "CacheReport",
    "Counters",
    "Handler",
    "InlineHandler",
    "Later",
    "ObserveRequest",
    "Operation",
    "ServerState",
]

_R = TypeVar("_R", bound=Request)
Handler = Callable[[Any, Any], Awaitable[Reply]]
"""``async def handler(session, request) -> reply``; raise ``RequestError`` to answer an error."""


class Later:
    """What an inline handler returns when the rest of its work must wait: ``run()`` finishes
    it in a task (a child task of the session for a concurrent operation, else the session's
    own task, in order)."""

    __slots__ = ("abandon", "run")

    def __init__(
        self, run: Callable[[], Awaitable[Reply]], abandon: Callable[[], None] | None = None
    ) -> None:
        self.run = run
        self.abandon = abandon
        """Undoes what the handler counted for ``run`` (idempotent, also after ``run``): for
        whoever may drop a Later without running it (a batch cancelled before its part ran)."""


ObserveRequest = Callable[[str, ErrorCode | None, float], None]
"""``(operation, error code or None, seconds)``, called once per answered request."""

InlineHandler = Callable[[Any, Any], "Reply | Later"]
"""``def handler(session, request) -> reply or Later``: never waits; answered by the router in
the same scheduling round the request arrived in (see ``Session.handle_now``)."""


@attrs.frozen
class Operation:
    """How the server runs one operation."""

    handler: Callable[[Any, Any], Any]
    """A :data:`Handler`, or an :data:`InlineHandler` if ``inline``."""
    concurrent: bool = False
    """Run as a child task of the session (replies may overtake earlier requests' replies)."""
    inline: bool = False


class SessionView(Protocol):
    """What the state needs of a live session (the session module imports the state, not
    the other way round)."""

    @property
    def id(self) -> str: ...

    @property
    def principal(self) -> Principal: ...

    def stats(self, now: float) -> SessionStats: ...


class CacheReport(Protocol):
    """The cache's part of ``stats`` (the cache service; a server without one reports none)."""

    def stats(self) -> CacheStats: ...

    def l2_stats(self) -> tuple[L2Stats, ...]: ...


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

    def __init__(
        self,
        config: ServerConfig,
        endpoint: str,
        auth: ServerAuth | None = None,
        *,
        cache: CacheReport | None = None,
        observe_request: ObserveRequest | None = None,
        l1_sizing: str = "",
        instance_id: str = "",
        events: EventPublisher | None = None,
    ) -> None:
        """``instance_id``: this server's (a new one if empty; its L2 tier's fleet records
        carry it too); ``events``: the KV event publisher (``--events``), if any."""
        self.config = config
        self.auth = auth or ServerAuth("ipc" if endpoint.startswith("ipc://") else "insecure")
        """Who clients are and how many sessions they may hold (see ``_auth``)."""
        self.session_id_key = os.urandom(16)
        """Keys the session ids shown in stats and logs: they never reveal a routing id."""
        self.endpoint = endpoint
        """The endpoint actually bound (a tcp port of 0 resolved)."""
        self.instance_id = instance_id or uuid.uuid4().hex
        self.started_at = trio.current_time()
        self.counters = Counters()
        self.sessions: dict[bytes, SessionView] = {}
        self.operations: dict[type[Request], Operation] = {}
        self.inline_operations: dict[str, Operation] = {}
        """Operation name → operation, for those the router answers inline."""
        self.cache = cache
        """Reports the cache's part of the ``stats`` reply."""
        self.draining = False
        self.serving = False
        """True once the router takes requests (``/healthz`` answers 200 while not draining)."""
        self.observe_request = observe_request
        """The metrics' observer of every answered request, if any (see :data:`ObserveRequest`)."""
        self.pending = 0
        """Requests accepted by the router that have not been answered (or dropped) yet."""
        self.l1_sizing = l1_sizing
        """Why L1 has its size (``default``, ``configured``, ``50% of /dev/shm's 3GiB free``)."""
        self.events = events
        """The KV event publisher (``--events``), if any (it runs in the root nursery)."""
        self.heartbeats = Heartbeats(config.heartbeat_timeout)
        """The sessions' heartbeat deadlines, in the loop's progress time (its task runs in
        the server's root nursery)."""
        self._idle = trio.Event()

    def register(
        self,
        request_type: type[_R],
        handler: Callable[[Any, _R], Awaitable[Reply]],
        *,
        concurrent: bool = False,
    ) -> None:
        """Declare the handler of ``request_type`` (one per type; later registrations replace)."""
        self.operations[request_type] = Operation(handler, concurrent)
        self.inline_operations.pop(request_type.op, None)

    def register_inline(
        self,
        request_type: type[_R],
        handler: Callable[[Any, _R], Reply | Later],
        *,
        concurrent: bool = False,
    ) -> None:
        """Declare a handler that never waits (it may hand what must wait to a :class:`Later`).

        Its requests are answered by the router as they are read, when their session has
        nothing queued before them; ``concurrent`` says where a :class:`Later` runs.
        """
        operation = Operation(handler, concurrent, inline=True)
        self.operations[request_type] = operation
        self.inline_operations[request_type.op] = operation

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

    def storage(self) -> dict[str, Any]:
        """Where the server keeps data, how much it may take, and why L1 has its size."""
        return storage_summary(self.config, self.l1_sizing)

    def stats(self, caller: SessionView | None = None) -> StatsReply:
        """The ``stats`` reply as ``caller`` may see it (None: an operator, who sees all).

        A caller that may use every tenant (the local user of an ipc server, an admin key)
        sees every session; a client key sees only its own key's sessions, an anonymous
        client only its own session: client names and request counts of other tenants are
        not its business.
        """
        now = trio.current_time()
        sessions = list(self.sessions.values())
        if caller is not None and ANY_TENANT not in caller.principal.tenants:
            user = caller.principal.user_id
            sessions = [s for s in sessions if user and s.principal.user_id == user] or [caller]
        c = self.counters
        return StatsReply(
            server_version=__version__,
            instance_id=self.instance_id,
            uptime_seconds=now - self.started_at,
            phase=self.phase,
            config={**config_summary(self.config), "storage": self.storage()},
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
            sessions=tuple(session.stats(now) for session in sessions),
            cache=self.cache.stats() if self.cache is not None else None,
            l2=self.cache.l2_stats() if self.cache is not None else (),
        )
