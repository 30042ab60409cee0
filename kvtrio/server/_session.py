"""One task per client connection: its requests in order, its resources, its heartbeat deadline."""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Awaitable, Callable

import trio

from .._logging import event
from ..errors import ErrorCode, RequestError
from ..protocol import (
    Goodbye,
    Request,
    SessionStats,
    decode_request,
    encode_error,
    encode_reply,
)
from ._auth import Principal, check_tenant
from ._handoff import Incoming, Replies
from ._state import Later, Operation, ServerState

__all__ = ["CLEANUP_TIMEOUT", "Session"]

log = logging.getLogger("kvtrio.server")

_BURST = 32
"""Queued requests a session handles before it yields to other tasks."""
CLEANUP_TIMEOUT = 5.0
"""Seconds a session's shielded cleanup may take before it is abandoned (and logged)."""

Cleanup = Callable[[], Awaitable[None]]
_GOODBYE = Goodbye.op


class Session:
    """The server side of one client connection (one ZeroMQ routing id).

    Requests are handled one after the other, so a worker's STORE and RETRIEVE stay ordered,
    except operations registered as concurrent, which run as child tasks. Requests of inline
    operations are answered by the router itself (:meth:`handle_now`) while the session has
    nothing queued; otherwise they queue behind the earlier ones. The session ends when its
    client has been silent for ``heartbeat_timeout`` of the loop's progress (a deadline pushed
    back by every message, kept by the server's :class:`~._heartbeats.Heartbeats`: time the
    loop was stalled does not count), when :meth:`end` is called, or when the server stops;
    then its cleanups run, shielded and bounded by :data:`CLEANUP_TIMEOUT`.
    """

    def __init__(
        self, identity: bytes, state: ServerState, outbox: Replies, principal: Principal
    ) -> None:
        self.identity = identity
        self.principal = principal
        """Who the client is (its key) and which tenants it may name."""
        serial = state.counters.sessions_started.to_bytes(8, "little")  # (this one's number)
        self.id = hashlib.blake2b(
            identity + serial, digest_size=12, key=state.session_id_key
        ).hexdigest()
        """Names the session in stats, logs and the cache's tables; reveals nothing of the
        routing id (which a client could otherwise use to take over another's connection).
        Unique to this session, not its routing id: a client that goes on after its session
        ended (a goodbye, a silence past ``heartbeat_timeout``) gets a new session, which the
        old one's cleanup, still releasing by id, must not touch (was: its registration was
        dropped just after it was answered ok)."""
        self.state = state
        self._outbox = outbox
        self._send, self._receive = trio.open_memory_channel[Incoming](
            state.config.session_queue_size
        )
        self.scope = trio.CancelScope()
        now = trio.current_time()
        self.started_at = now
        self.last_seen = now
        self.client_name = ""
        self.client_version = ""
        self.requests = 0
        self.errors = 0
        self.idle = False
        """True while the session's task waits on an empty queue: a request may then be
        answered inline without overtaking an earlier one. Cleared by :meth:`offer`."""
        self._children: trio.Nursery | None = None
        self._active: set[Incoming] = set()
        """Requests taken from the queue (or deferred) and not answered yet."""
        self.end_reason: str | None = None
        self._cleanups: list[Cleanup] = []
        self._heartbeat_timeout = state.config.heartbeat_timeout
        self._deadline = -math.inf
        self.touch(now)

    @property
    def in_flight(self) -> int:
        return len(self._active)

    @property
    def ending(self) -> bool:
        """True once the session has been told to end (it takes no new requests then)."""
        return self.scope.cancel_called

    @property
    def user(self) -> str:
        """Its client key's id (``""``: none), as the cache core counts callers."""
        return self.principal.user_id

    def __repr__(self) -> str:
        name = f" {self.client_name}" if self.client_name else ""
        return f"<Session {self.id}{name}>"

    # ----------------------------------------------------------------- used by the router

    def touch(self, now: float) -> None:
        """The client was heard from: push the heartbeat deadline back.

        The deadline is in progress time (see ``_heartbeats``) and moves only once it lags by
        more than 5% of the timeout (moving it costs a heap operation; a message rate of
        thousands per second need not pay it each time), so a silent session ends between 1
        and 1.05 timeouts (plus one tick of the heartbeat clock) after its last message.
        """
        self.last_seen = now
        heartbeats = self.state.heartbeats
        deadline = heartbeats.progress(now) + self._heartbeat_timeout
        if deadline - self._deadline > self._heartbeat_timeout * 0.05:
            self._deadline = deadline
            heartbeats.watch(self)

    @property
    def heartbeat_deadline(self) -> float:
        """When the session expires unless its client is heard from, in progress time."""
        return self._deadline

    def expire(self) -> None:
        """The client has been silent past the heartbeat timeout: end the session."""
        if self.end_reason is None:
            self.end_reason = "heartbeat timeout"
            self.state.counters.sessions_expired += 1
        self.scope.cancel()

    def offer(self, item: Incoming) -> bool:
        """Queue a request without waiting; False if the session's queue is full."""
        self.idle = False
        try:
            self._send.send_nowait(item)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        return True

    def handle_now(self, item: Incoming, operation: Operation) -> None:
        """Answer a request of an inline operation in the caller's scheduling round.

        Only while :attr:`idle` (nothing queued before it). A reply the client cannot take now,
        and the :class:`Later` part of a handler, go to the session's task, in order; every
        request still gets exactly one reply. Never waits.
        """
        self.requests += 1
        state = self.state
        goodbye = False
        try:
            request = decode_request(item.kind, item.body)
            tenant = getattr(request, "tenant", None)
            if isinstance(tenant, str):
                check_tenant(self.principal, tenant)
            result = operation.handler(self, request)
            if type(result) is Later:
                self._defer(item, result, operation.concurrent)
                return
            frames = encode_reply(item.call_id, item.kind, result)
            code = None
            goodbye = item.kind == _GOODBYE
        except RequestError as exc:
            code = exc.code
            frames = encode_error(item.call_id, code, exc.message)
        except Exception:
            code, frames = self._failed(item)
        if code is not None:
            self.errors += 1
            state.counters.error(code)
        if state.observe_request is not None:
            state.observe_request(item.kind, code, trio.current_time() - item.received)
        if not self._outbox.try_send(self.identity, frames):
            item.frames = frames  # the client's queue is full: the session task retries
            if self.offer(item):
                state.accepted()
            else:
                state.counters.replies_undeliverable += 1
        if goodbye:
            self.end("goodbye")

    def _defer(self, item: Incoming, later: Later, concurrent: bool) -> None:
        """Finish ``item`` with ``later`` in a child task (concurrent) or the session's task."""
        self.state.accepted()
        self._active.add(item)
        if concurrent and self._children is not None:
            self._children.start_soon(self._run_later, item, later)
            return
        item.later = later
        if not self.offer(item):  # (idle: the queue was empty)
            self._active.discard(item)
            self._outbox.answer_now(
                self.identity, item.call_id, ErrorCode.BUSY, "retry later", item.kind
            )
            self.state.settled()

    # ----------------------------------------------------------------- used by handlers

    def add_cleanup(self, cleanup: Cleanup) -> None:
        """Run ``cleanup`` when the session ends (last added, first run; shielded, bounded)."""
        self._cleanups.append(cleanup)

    def end(self, reason: str) -> None:
        """End the session: cancel its tasks and run its cleanups."""
        if self.end_reason is None:
            self.end_reason = reason
        self.scope.cancel()

    def stats(self, now: float) -> SessionStats:
        return SessionStats(
            session_id=self.id,
            client_name=self.client_name,
            client_version=self.client_version,
            age_seconds=now - self.started_at,
            idle_seconds=now - self.last_seen,
            requests=self.requests,
            errors=self.errors,
            in_flight=self.in_flight,
        )

    # ----------------------------------------------------------------- the task

    async def run(self) -> None:
        """Serve this client's requests until the session ends, then clean up.

        Cancellation (server stop, :meth:`end`, heartbeat deadline) ends the session; cleanup
        runs shielded either way.
        """
        log.debug("session %s started", self.id)
        try:
            with self.scope:
                async with trio.open_nursery() as children:
                    self._children = children
                    await self._serve_queue(children)
        finally:
            self._children = None
            self.idle = False
            await self._close()

    async def _serve_queue(self, children: trio.Nursery) -> None:
        """Handle queued requests in order, without a scheduling round per request: queued
        requests are taken directly, and the task yields every :data:`_BURST` of them so other
        sessions get their turn."""
        receive = self._receive
        burst = 0
        while True:
            try:
                item = receive.receive_nowait()
            except trio.WouldBlock:
                burst = 0
                self.idle = True  # the router may answer the next request inline
                try:
                    item = await receive.receive()
                except trio.EndOfChannel:
                    return
            except trio.EndOfChannel:
                return
            else:
                burst += 1
                if burst >= _BURST:
                    burst = 0
                    await trio.lowlevel.checkpoint()
            await self._dispatch(item, children)

    async def _dispatch(self, item: Incoming, children: trio.Nursery) -> None:
        if item.frames is not None:  # answered inline; the client's queue was full
            try:
                await self._outbox.reply(self.identity, item.frames)
            finally:
                item.frames = None
                self.state.settled()
            return
        if item.later is not None:  # an inline handler's remaining part, in order
            await self._run_later(item, item.later)
            return
        self.requests += 1
        self._active.add(item)
        try:
            if item.error is not None:
                raise item.error
            request = decode_request_for(self.state, item)
            tenant = getattr(request, "tenant", None)
            if isinstance(tenant, str):
                check_tenant(self.principal, tenant)
            operation = self.state.operations[type(request)]
        except RequestError as exc:
            await self._finish(item, encode_error(item.call_id, exc.code, exc.message), exc.code)
            return
        if operation.inline:
            await self._handle_inline(item, request, operation, children)
        elif operation.concurrent:
            children.start_soon(self._handle, item, request, operation)
        else:
            await self._handle(item, request, operation)

    async def _handle_inline(
        self, item: Incoming, request: Request, operation: Operation, children: trio.Nursery
    ) -> None:
        """An inline operation's request that was queued (its session was busy)."""
        code: ErrorCode | None
        try:
            result = operation.handler(self, request)
        except RequestError as exc:
            code = exc.code
            frames = encode_error(item.call_id, code, exc.message)
        except Exception:
            code, frames = self._failed(item)
        else:
            if type(result) is Later:
                if operation.concurrent:
                    children.start_soon(self._run_later, item, result)
                else:
                    await self._run_later(item, result)
                return
            code, frames = None, encode_reply(item.call_id, item.kind, result)
        await self._finish(item, frames, code)
        if code is None and type(request) is Goodbye:
            self.end("goodbye")

    async def _run_later(self, item: Incoming, later: Later) -> None:
        code: ErrorCode | None = None
        try:
            reply = await later.run()
            frames = encode_reply(item.call_id, item.kind, reply)
        except RequestError as exc:
            code = exc.code
            frames = encode_error(item.call_id, exc.code, exc.message)
        except Exception:
            code, frames = self._failed(item)
        await self._finish(item, frames, code)

    async def _handle(self, item: Incoming, request: Request, operation: Operation) -> None:
        code: ErrorCode | None = None
        try:
            reply = await operation.handler(self, request)
            frames = encode_reply(item.call_id, item.kind, reply)
        except RequestError as exc:
            code = exc.code
            frames = encode_error(item.call_id, exc.code, exc.message)
        except Exception:
            code, frames = self._failed(item)
        await self._finish(item, frames, code)
        if type(request) is Goodbye:  # answered: end now, not at the heartbeat timeout
            self.end("goodbye")

    def _failed(self, item: Incoming) -> tuple[ErrorCode, list[bytes]]:
        log.exception("%s: %r request %d failed", self, item.kind, item.call_id)
        message = f"the server failed while handling {item.kind!r} (see its log)"
        return ErrorCode.INTERNAL, encode_error(item.call_id, ErrorCode.INTERNAL, message)

    async def _finish(self, item: Incoming, frames: list[bytes], code: ErrorCode | None) -> None:
        self._active.discard(item)
        state = self.state
        if code is not None:
            self.errors += 1
            state.counters.error(code)
        try:
            await self._outbox.reply(self.identity, frames)
        finally:
            state.settled()
            if state.observe_request is not None:
                state.observe_request(item.kind, code, trio.current_time() - item.received)

    async def _close(self) -> None:
        """Answer what is left, run cleanups shielded and bounded, forget the session."""
        if self.state.sessions.get(self.identity) is self:
            del self.state.sessions[self.identity]
        self.state.auth.sessions_by_user[self.principal.user_id] -= 1  # counted at its start
        self._send.close()
        unanswered = set(self._active)
        self._active.clear()
        while True:
            try:
                unanswered.add(self._receive.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        self._receive.close()
        if self.end_reason is None or self.state.draining:
            code, message = ErrorCode.SHUTTING_DOWN, "the server stopped before answering"
        else:
            code = ErrorCode.SESSION_ENDED
            message = f"the session ended ({self.end_reason}) before answering; retry"
        for item in unanswered:  # exactly one reply each, also now
            if item.frames is not None:  # answered already, not delivered yet
                self._outbox.send_or_count(self.identity, item.frames)
            else:
                self._outbox.answer_now(self.identity, item.call_id, code, message, item.kind)
        self.state.settled(len(unanswered))
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + CLEANUP_TIMEOUT
            for cleanup in reversed(self._cleanups):
                try:
                    await cleanup()
                except Exception:
                    log.exception("%s: cleanup %r failed", self, cleanup)
        if scope.cancelled_caught:
            log.error("%s: cleanup did not finish within %ss", self, CLEANUP_TIMEOUT)
        self.state.counters.sessions_ended += 1
        reason = self.end_reason or "server stopping"
        log.info(
            "session %s ended (%s)",
            self.id,
            reason,
            extra=event(
                "session_end",
                session=self.id,
                client=self.client_name,
                reason=reason,
                requests=self.requests,
                errors=self.errors,
            ),
        )


def decode_request_for(state: ServerState, item: Incoming) -> Request:
    """Decode ``item``'s body; an operation the protocol knows but this server does not serve
    is reported as unknown."""
    request = decode_request(item.kind, item.body)
    if type(request) not in state.operations:
        raise RequestError(ErrorCode.UNKNOWN_OPERATION, f"operation {item.kind!r} is not served")
    return request
