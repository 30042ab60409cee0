"""The router task: owns the ROUTER socket's receiving side, reads headers, answers or routes.

The router is the task that consumes the socket's readiness edge: on each wake-up it drains the
socket (non-blocking receives until it is empty) and, for every request, either answers it
inline (operations whose handler never waits, when the session has nothing queued before it)
or puts it in its session's bounded queue without blocking (a full queue is answered ``busy``).
So a burst of pings costs one scheduling round, not four per request, and one slow client
cannot stall another. Replies go out through the :class:`Outbox`; a client whose receive queue
is full delays only its own session.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import trio

from ..errors import ErrorCode, ProtocolError, RequestError
from ..protocol import HeaderError, read_request_header
from ..transport import Socket
from ._handoff import Incoming
from ._outbox import Outbox
from ._session import Session
from ._state import ServerState

__all__ = ["MAX_HEADER_SIZE", "Router"]

log = logging.getLogger("kvtrio.server")

MAX_HEADER_SIZE = 1024
"""A header frame larger than this cannot be valid; such a message is dropped unread."""
_BATCH = 64
"""Messages routed per wakeup before the router yields to other tasks."""


class Router:
    def __init__(self, state: ServerState, socket: Socket, sessions: trio.Nursery) -> None:
        self._state = state
        self._socket = socket
        self._sessions = sessions
        self.outbox = Outbox(state, socket)
        self.answer_now = self.outbox.answer_now

    async def run(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        """Receive and route (or answer) messages until cancelled; the socket must have been
        opened with ``pump=False`` (this task is its one reader)."""
        task_status.started()
        await self._socket.serve_edge(self._drain)

    def _drain(self) -> bool:
        """Route up to :data:`_BATCH` queued messages; False once the socket is empty."""
        socket = self._socket
        if self._state.auth.curve:  # each message with the user id of its connection
            receive = socket.try_recv_authenticated
            for _ in range(_BATCH):
                message = receive()
                if message is None:
                    return False
                self.route(*message)
            return True
        receive_frames = socket.try_recv_multipart
        for _ in range(_BATCH):
            frames = receive_frames()
            if frames is None:
                return False
            self.route(frames)
        return True

    def route(self, frames: list[bytes], user: str = "") -> None:
        """Hand one message to its session, or answer/drop it here. Never waits.

        ``user`` is the ZAP user id of the connection it came from (CURVE only).
        """
        state = self._state
        identity, parts = frames[0], frames[1:]
        if not parts or len(parts[0]) > MAX_HEADER_SIZE:
            self._drop(identity, "no readable header")
            return
        now = trio.current_time()
        try:
            call_id, kind = read_request_header(parts[0])
        except HeaderError as exc:
            if exc.call_id is None:
                self._drop(identity, exc.message)
                return
            item = Incoming(exc.call_id, "?", b"", exc, now)
        else:
            item = Incoming(call_id, kind, parts[-1], _check_frames(parts, state), now)
        state.counters.requests += 1
        session: Session | None = state.sessions.get(identity)  # type: ignore[assignment]
        if session is not None and session.ending:
            session = None  # ended but not cleaned up yet: this message starts a new session
        if state.draining:
            self.answer_now(
                identity,
                item.call_id,
                ErrorCode.SHUTTING_DOWN,
                "the server is shutting down",
                item.kind,
            )
            return
        if session is not None and session.principal.user_id != user:
            # Another key's connection took over this routing id: it gets nothing of the session.
            self.answer_now(
                identity,
                item.call_id,
                ErrorCode.FORBIDDEN,
                "this routing id belongs to another client's session",
                item.kind,
            )
            return
        if session is None:
            if item.error is not None:  # nothing to keep in order with: answer here
                self.answer_now(
                    identity, item.call_id, item.error.code, item.error.message, item.kind
                )
                return
            started = self._start_session(identity, user, item)
            if started is None:
                return
            session = started
        session.touch(now)
        if session.idle and item.error is None:
            operation = state.inline_operations.get(item.kind)
            if operation is not None:
                session.handle_now(item, operation)
                return
        if session.offer(item):
            state.accepted()
        else:
            self.answer_now(
                identity,
                item.call_id,
                ErrorCode.BUSY,
                f"more than {state.config.session_queue_size} requests queued; retry later",
                item.kind,
            )

    def _start_session(self, identity: bytes, user: str, item: Incoming) -> Session | None:
        """Start the session of a new client, or refuse ``item`` (and return None) if its key
        is unknown or it would exceed a session limit."""
        auth = self._state.auth
        principal = auth.principal(user)
        if principal is None:
            self.answer_now(
                identity, item.call_id, ErrorCode.FORBIDDEN, "unknown client key", item.kind
            )
            return None
        refusal = auth.session_refusal(principal, len(self._state.sessions))
        if refusal is not None:
            self._state.counters.sessions_refused += 1
            self.answer_now(identity, item.call_id, ErrorCode.BUSY, refusal, item.kind)
            return None
        session = Session(identity, self._state, self.outbox, principal)
        auth.sessions_by_user[principal.user_id] += 1
        self._state.sessions[identity] = session
        self._state.counters.sessions_started += 1
        self._sessions.start_soon(session.run, name=f"kvtrio session {session.id}")
        return session

    def _drop(self, identity: bytes, why: str) -> None:
        self._state.counters.frames_dropped += 1
        log.debug("dropped a message from %s: %s", identity.hex(), why)


def _check_frames(parts: list[bytes], state: ServerState) -> RequestError | None:
    """The error a well-headed request must get for its framing or size, if any."""
    if len(parts) != 2:
        return ProtocolError(f"a request is 2 frames [header, body], got {len(parts)}")
    size = len(parts[0]) + len(parts[1])
    if size > state.config.max_message_size:
        return RequestError(
            ErrorCode.MESSAGE_TOO_LARGE,
            f"the request is {size} bytes, the limit is {state.config.max_message_size}",
        )
    return None
