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

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import (
    ConnectionLost,
    KvtrioError,
    ProtocolError,
    RequestTimeout,
    ServerUnavailable,
)
from ._common import read_reply_header, reply_or_error
from ._state import Call, ClientState, Outcome

__all__ = ["Connection"]

# Plain ints: pyzmq's constants are enum flags, and flag arithmetic costs microseconds per call.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_EVENTS = zmq.EVENTS  # the enum member: pyzmq converts an int option to it first (+1 µs)
_POLLIN = int(zmq.POLLIN)
_HANDSHAKE_SUCCEEDED = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)


class Connection:
    """Calls, the queue of unsent requests, deadlines; the socket. Only under the socket lock
    (:attr:`ClientState.socket_lock`); it writes the ``state``'s ``status``, ``in_flight``,
    ``handshake_error`` and takes from its ``outbox``.

    None of its methods blocks (every send and receive is NOBLOCK) or waits for anything, so
    none has a timeout. A KeyboardInterrupt (main thread only, when a caller holds the lock)
    in the middle of one can lose the call it was handling between two steps (taken from the
    outbox or the calls, not yet queued or settled): its future then never settles. Python
    cannot make those steps atomic; the window is a few bytecodes.
    """

    def __init__(
        self, state: ClientState, dealer: zmq.Socket[bytes], monitor: zmq.Socket[bytes]
    ) -> None:
        self.state = state
        self.dealer = dealer
        self.dealer_fd = int(dealer.getsockopt(zmq.FD))
        """The socket's file descriptor: readable (edge-triggered) when messages may have
        arrived; re-armed by every drain (:meth:`read_replies`)."""
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

    def pop(self, call_id: int) -> Call | None:
        """Forget a call (answered, expired or failed); keeps ``in_flight`` exact."""
        call = self.calls.pop(call_id, None)
        if call is not None and call.sent:
            self.state.in_flight -= 1
        return call

    def fail(self, call: Call, error: BaseException) -> None:
        """Settle ``call`` with ``error`` once the lock is released."""
        self.settled.append((call, error))

    def pump(self) -> None:
        """Send what is queued, receive what arrived, expire what is late."""
        if self.state.outbox:
            self.take_outbox()
        if self.unsent:
            self.flush()
        self.read_replies()
        if self.deadlines and self.deadlines[0][0] <= time.monotonic():
            self.expire(time.monotonic())

    def take_outbox(self) -> None:
        """Take the callers' submitted requests into the calls, to be sent in order (a
        cancelled one is dropped; a ``fail_fast`` one fails at once while disconnected)."""
        state = self.state
        outbox = state.outbox
        while outbox:
            call_id, call = outbox.popleft()
            if call.future.finished:  # cancelled before it was sent
                continue
            if call.fail_fast and state.status == "disconnected":
                self.fail(call, ServerUnavailable(state.unreachable()))
                continue
            self.calls[call_id] = call
            heapq.heappush(self.deadlines, (call.deadline, call_id))
            self.unsent.append((call_id, call))

    def flush(self) -> None:
        """Send queued requests while the connection is up (see ``dealer_options``); at the
        high-water mark the rest waits for the next flush."""
        state = self.state
        send = self.dealer.send
        while self.unsent and state.status == "connected":
            call_id, call = self.unsent[0]
            if call_id not in self.calls:  # expired while waiting to be sent
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
            state.in_flight += 1
            call.frames = []
            self.last_send = time.monotonic()

    def expire(self, now: float) -> None:
        """Fail the calls whose deadline is ``now`` or past: ``RequestTimeout`` if sent,
        ``ServerUnavailable`` if not (never processed)."""
        endpoint = self.state.endpoint
        while self.deadlines and self.deadlines[0][0] <= now:
            _, call_id = heapq.heappop(self.deadlines)
            call = self.pop(call_id)
            if call is None:
                continue
            if call.sent:
                error: KvtrioError = RequestTimeout(
                    f"no reply to {call.request_type.op!r} from {endpoint} in time"
                )
            else:
                error = ServerUnavailable(self.state.unreachable(with_handshake=False))
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
        """Follow the connection's monitor events: the handshake's verdict, ``status``; on a
        disconnect, read what already arrived, then fail what is still in flight
        (``ConnectionLost``) and the unsent ``fail_fast`` calls."""
        state = self.state
        while True:
            try:
                message = parse_monitor_message(self.monitor.recv_multipart(_NOBLOCK))
            except zmq.Again:
                return
            event = int(message["event"])
            failure = state.handshake.observe(event, int(message["value"]))
            if failure is not None:
                state.log_warning(failure)
            state.handshake_error = state.handshake.error  # kept through disconnections
            if event == _HANDSHAKE_SUCCEEDED:
                state.status = "connected"
                self.on_connected()
                continue
            if state.status == "connected":
                state.log_lost()
            state.status = "disconnected"
            if not state.handshake.undecided:  # (the next event says why, in ~0.1 s)
                self.fail_unsent_fail_fast()
            if event == _DISCONNECTED:
                self.read_replies()  # replies that arrived before the close are still good
                for call_id, call in list(self.calls.items()):
                    if call.sent:
                        self.pop(call_id)
                        self.fail(call, ConnectionLost(f"connection to {state.endpoint} lost"))

    def fail_unsent_fail_fast(self) -> None:
        """Requests that may not wait for a connection fail once the server is known down."""
        for call_id, call in list(self.calls.items()):
            if call.fail_fast and not call.sent:
                self.pop(call_id)
                self.fail(call, ServerUnavailable(self.state.unreachable()))

    def add(self, call_id: int, call: Call, *, first: bool = False) -> None:
        """Queue a call made by the client itself (hello, heartbeat), ahead of others if
        ``first``."""
        self.calls[call_id] = call
        heapq.heappush(self.deadlines, (call.deadline, call_id))
        if first:
            self.unsent.appendleft((call_id, call))
        else:
            self.unsent.append((call_id, call))
        self.flush()
        self.read_replies()  # a send may have consumed the socket's edge: drain to re-arm it

    def close(self, error: BaseException) -> None:
        """Fail every call, queued or in flight, with ``error`` and close the sockets (the
        background thread, as it ends). Other threads see :attr:`closed` and leave it alone."""
        self.take_outbox()
        for call in self.calls.values():
            self.fail(call, error)
        self.closed = True
        self.dealer.disable_monitor()  # before closing its reader: see transport.open_monitor
        self.monitor.close(linger=0)
        self.dealer.close(linger=0)
