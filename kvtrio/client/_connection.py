"""The synchronous client's connection state: the DEALER socket and the calls on it.

Every method here runs under the client's socket lock, in whichever thread holds it (a caller
that needs a reply, or the background thread). ZeroMQ sockets may change threads behind a full
memory barrier, which the lock gives. Futures are never settled under the lock: the outcomes
collect in :attr:`Connection.settled` and the lock's holder settles them after releasing it, so
a done callback may submit requests.
"""

from __future__ import annotations

import collections
import heapq
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import (
    ConnectionLost,
    KvtrioError,
    ProtocolError,
    RequestTimeout,
    ServerUnavailable,
)
from ..protocol import Reply, Request
from ._common import read_reply_header, reply_or_error

if TYPE_CHECKING:
    from ._sync import Client

__all__ = ["Call", "Connection", "ReplyFuture", "unreachable"]

# Plain ints: pyzmq's constants are enum flags, and flag arithmetic costs microseconds per call.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_EVENTS = zmq.EVENTS  # the enum member: pyzmq converts an int option to it first (+1 µs)
_POLLIN = int(zmq.POLLIN)
_HANDSHAKE_SUCCEEDED = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)

Outcome = tuple["Call", "Reply | BaseException"]


class ReplyFuture(Future[Reply]):
    """A future whose ``result()``/``exception()`` drive the client's I/O in the calling thread
    (so a waiting caller receives its own reply, no thread hand-off)."""

    def __init__(self, client: Client | None, deadline: float) -> None:
        super().__init__()
        self._client = client
        self.deadline = deadline
        self.finished = False
        """True once settled or cancelled: what the client's loops read, without taking the
        future's lock (``done()`` takes it)."""

    def result(self, timeout: float | None = None) -> Reply:
        if self._client is not None and not self.finished:
            self._client._wait(self, timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._client is not None and not self.finished:
            self._client._wait(self, timeout)
        return super().exception(timeout)

    # ``finished`` is set first: done callbacks run inside ``set_result`` and may call
    # ``result()``, which must not wait then (the base class's ``result()`` waits for the
    # state under the future's lock, so setting it early is safe).
    def set_result(self, result: Reply) -> None:
        self.finished = True
        super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        self.finished = True
        super().set_exception(exception)

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled:
            self.finished = True
            if self._client is not None:
                self._client._wake_waiters()  # a caller may be waiting for it
        return cancelled

    def add_done_callback(self, fn: Callable[[Future[Reply]], object]) -> None:
        """As usual; a pending future with a callback has the background thread receive its
        reply if no caller does."""
        super().add_done_callback(fn)
        if self._client is not None and not self.finished:
            self._client._want_background()


class Call:
    __slots__ = ("deadline", "fail_fast", "frames", "future", "on_reply", "request_type", "sent")

    def __init__(
        self, request: Request, frames: list[bytes], future: ReplyFuture, fail_fast: bool
    ) -> None:
        self.request_type = type(request)
        self.frames = frames
        self.deadline = future.deadline
        self.fail_fast = fail_fast
        self.future = future
        self.sent = False
        self.on_reply: Callable[[Reply], None] | None = None
        """For the client's own requests: run under the lock as the reply is received (so a
        hello's answer is known before any reply that came after it is settled)."""


class Connection:
    """Calls, the queue of unsent requests, deadlines; the socket. Only under the socket lock."""

    def __init__(self, client: Client, dealer: zmq.Socket[bytes], monitor: zmq.Socket[bytes]):
        self.client = client
        self.dealer = dealer
        self.monitor = monitor
        self.closed = False
        self.calls: dict[int, Call] = {}
        self.unsent: collections.deque[tuple[int, Call]] = collections.deque()
        self.deadlines: list[tuple[float, int]] = []
        self.settled: list[Outcome] = []
        self.last_send = time.monotonic()
        self.on_connected: Callable[[], None] = lambda: None

    def take_settled(self) -> Sequence[Outcome]:
        """The outcomes collected so far, to settle after releasing the lock."""
        settled = self.settled
        if not settled:
            return ()  # (not the list itself: others append to it once the lock is free)
        self.settled = []
        return settled

    def pop(self, request_id: int) -> Call | None:
        """Forget a call (answered, expired or failed); keeps ``Client.in_flight`` exact."""
        call = self.calls.pop(request_id, None)
        if call is not None and call.sent:
            self.client.in_flight -= 1
        return call

    def fail(self, call: Call, error: BaseException) -> None:
        self.settled.append((call, error))

    def pump(self) -> None:
        """Send what is queued, receive what arrived, expire what is late."""
        if self.client._outbox:
            self.take_outbox()
        if self.unsent:
            self.flush()
        self.read_replies()
        if self.deadlines and self.deadlines[0][0] <= time.monotonic():
            self.expire(time.monotonic())

    def take_outbox(self) -> None:
        client = self.client
        outbox = client._outbox
        while outbox:
            request_id, call = outbox.popleft()
            if call.future.finished:  # cancelled before it was sent
                continue
            if call.fail_fast and client.state == "disconnected":
                self.fail(call, ServerUnavailable(unreachable(client)))
                continue
            self.calls[request_id] = call
            heapq.heappush(self.deadlines, (call.deadline, request_id))
            self.unsent.append((request_id, call))

    def flush(self) -> None:
        """Send queued requests while the connection is up (see ``dealer_options``)."""
        client = self.client
        send = self.dealer.send
        while self.unsent and client.state == "connected":
            request_id, call = self.unsent[0]
            if request_id not in self.calls:  # expired while waiting to be sent
                self.unsent.popleft()
                continue
            frames = call.frames
            try:  # frame by frame, plain-int flags (send_multipart does enum arithmetic)
                send(frames[0], _SNDMORE_NOBLOCK)  # once the first frame is taken, the rest
                send(frames[1], _NOBLOCK)  # is (a multipart message is atomic)
            except zmq.Again:
                return
            self.unsent.popleft()
            call.sent = True
            client.in_flight += 1
            call.frames = []
            self.last_send = time.monotonic()

    def expire(self, now: float) -> None:
        endpoint = self.client.endpoint
        while self.deadlines and self.deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self.deadlines)
            call = self.pop(request_id)
            if call is None:
                continue
            if call.sent:
                error: KvtrioError = RequestTimeout(
                    f"no reply to {call.request_type.op!r} from {endpoint} in time"
                )
            else:
                error = ServerUnavailable(unreachable(self.client, with_handshake=False))
            self.fail(call, error)

    def read_replies(self) -> None:
        """Receive until the socket is empty (which also re-arms its edge-triggered FD).

        Asks ``ZMQ_EVENTS`` before each receive rather than receiving until ``EAGAIN``: pyzmq
        raises ``zmq.Again`` for it, and making that exception costs 4x the question.
        """
        dealer = self.dealer
        events, recv = dealer.getsockopt, dealer.recv
        while events(_EVENTS) & _POLLIN:  # type: ignore[operator]
            try:  # frame by frame: recv_multipart reads RCVMORE through enum conversions
                frame = recv(_NOBLOCK, copy=False)
                frames = [frame.bytes]
                while frame.more:  # the rest of a multipart message is always there already
                    frame = recv(_NOBLOCK, copy=False)
                    frames.append(frame.bytes)
            except zmq.Again:  # pragma: no cover - EVENTS said a message was there
                return
            header = read_reply_header(frames)
            call = self.pop(header[0]) if header is not None else None
            if header is None or call is None or call.future.finished:  # (cancelled)
                continue
            try:
                outcome = reply_or_error(header[1], frames[1], call.request_type)
            except ProtocolError as exc:
                self.fail(call, exc)
                continue
            if call.on_reply is not None and not isinstance(outcome, BaseException):
                call.on_reply(outcome)
            self.settled.append((call, outcome))

    def read_monitor(self) -> None:
        client = self.client
        while True:
            try:
                message = parse_monitor_message(self.monitor.recv_multipart(_NOBLOCK))
            except zmq.Again:
                return
            event = int(message["event"])
            failure = client.handshake.observe(event, int(message["value"]))
            if failure is not None:
                client._log_warning(failure)
            client.handshake_error = client.handshake.error  # kept through disconnections
            if event == _HANDSHAKE_SUCCEEDED:
                client.state = "connected"
                self.on_connected()
                continue
            if client.state == "connected":
                client._log_lost()
            client.state = "disconnected"
            if not client.handshake.undecided:  # (the next event says why, in ~0.1 s)
                self.fail_unsent_fail_fast()
            if event == _DISCONNECTED:
                self.read_replies()  # replies that arrived before the close are still good
                for request_id, call in list(self.calls.items()):
                    if call.sent:
                        self.pop(request_id)
                        self.fail(call, ConnectionLost(f"connection to {client.endpoint} lost"))

    def fail_unsent_fail_fast(self) -> None:
        """Requests that may not wait for a connection fail once the server is known down."""
        for request_id, call in list(self.calls.items()):
            if call.fail_fast and not call.sent:
                self.pop(request_id)
                self.fail(call, ServerUnavailable(unreachable(self.client)))

    def add(self, request_id: int, call: Call, *, first: bool = False) -> None:
        """Queue a call made by the client itself (hello, heartbeat), ahead of others if
        ``first``."""
        self.calls[request_id] = call
        heapq.heappush(self.deadlines, (call.deadline, request_id))
        if first:
            self.unsent.appendleft((request_id, call))
        else:
            self.unsent.append((request_id, call))
        self.flush()
        self.read_replies()  # a send may have consumed the socket's edge: drain to re-arm it


def settle(outcomes: Sequence[Outcome]) -> None:
    """Settle futures (outside the socket lock: done callbacks may submit)."""
    for call, outcome in outcomes:
        future = call.future
        if not future.set_running_or_notify_cancel():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def unreachable(client: Any, *, with_handshake: bool = True) -> str:
    handshake_error = client.handshake_error if with_handshake else None
    if handshake_error is not None:
        return f"cannot reach {client.endpoint}: {handshake_error}"
    return f"cannot reach {client.endpoint} (no connection; is the server running?)"
