"""The synchronous client's background thread: connection events (hello on every connect and
after a server restart), heartbeats, deadlines, and replies nobody is waiting for.

It runs in :class:`~kvtrio.client._sync.Client`'s own thread and shares that client's
:class:`~kvtrio.client._state.ClientState` (the socket lock among it); the request path never
waits for it (see :mod:`kvtrio.client._sync`). It watches the socket only while a pending
future has done callbacks and no caller leads: otherwise it would take the GIL from a caller
spinning on ``poll()`` for each reply.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import zmq

from ..protocol import HelloReply, Ping, Pong, Reply, Request, encode_request
from ._common import heartbeat_interval, hello_request, ping_due
from ._connection import Connection
from ._state import Call, ClientState, ReplyFuture

__all__ = ["Background"]

log = logging.getLogger("kvtrio.client")


class Background:
    """The background thread's loop: connection events, heartbeats, deadlines, and replies
    nobody is waiting for. Made in that thread (it records its id)."""

    def __init__(self, state: ClientState, conn: Connection) -> None:
        self.state = state
        self.conn = conn
        self.thread_id = threading.get_ident()
        conn.on_connected = self.on_connected
        self.poller = zmq.Poller()
        self.poller.register(conn.monitor, zmq.POLLIN)
        self.poller.register(state.wake_r, zmq.POLLIN)
        self.watching = False
        self.changes: collections.deque[HelloReply] = collections.deque()

    def run(self) -> None:
        """Loop until the client closes: under the socket lock follow the monitor, send what is
        queued, expire deadlines, heartbeat and drain the socket; settle outside it; then sleep
        until the next deadline or heartbeat (at most 1 s), a wake-up, a monitor event or, if
        :attr:`ClientState.background_wanted` and no caller leads, a reply.

        Not interruptible (KeyboardInterrupt goes to the main thread); it ends after
        :attr:`ClientState.closing` is set and the pipe woke it (``Client.close``)."""
        state, conn = self.state, self.conn
        while not state.closing:
            with state.socket_lock:
                now = time.monotonic()
                conn.read_monitor()
                conn.pump()
                conn.expire(now)
                self.heartbeat(now)
                conn.read_replies()  # the heartbeat's send may have consumed the socket's edge
                settled = conn.take_settled()
                timeout_ms = self.poll_timeout(now)
            if settled:
                state.settle(settled)
            while self.changes:
                self.new_server(self.changes.popleft())
            if state.outbox:
                continue
            # Watch the socket only for replies no caller is waiting for (futures with
            # callbacks); the others are received by their callers, or here at the next wake.
            if not conn.calls:
                state.background_wanted = False
            watch = state.background_wanted and state.leader is None
            if watch != self.watching:
                self.watching = state.background_watches = watch
                if watch:
                    self.poller.register(conn.dealer_fd, zmq.POLLIN)
                else:
                    self.poller.unregister(conn.dealer_fd)
            events = dict(self.poller.poll(timeout_ms))
            if events.get(state.wake_r):
                state.take_wakeups()

    def poll_timeout(self, now: float) -> int:
        """Milliseconds to sleep: until the next deadline, heartbeat or retry of a send at the
        high-water mark, at most 1 s, at least 1 ms; published as
        :attr:`ClientState.background_wakes_at`. The heartbeat counts only while connected:
        nothing is sent while the server is away, so it would be due at every wake (was: a
        poll of 0 ms in a loop, a core and the engine's GIL taken for the whole outage)."""
        state, conn = self.state, self.conn
        connected = state.status == "connected"
        if conn.unsent and connected:  # at the high-water mark: retry soon
            wake_at = now + 0.005
        elif state.heartbeat and connected:
            wake_at = conn.last_send + self.heartbeat_interval()
        else:
            wake_at = now + 1
        if conn.deadlines:
            wake_at = min(wake_at, conn.deadlines[0][0])
        wake_at = max(now + 0.001, min(wake_at, now + 1))
        state.background_wakes_at = wake_at
        return int((wake_at - now) * 1000) + 1

    def heartbeat_interval(self) -> float:
        """A quarter of the server's heartbeat timeout (a default until its hello)."""
        return heartbeat_interval(self.state.server_info)

    def heartbeat(self, now: float) -> None:
        """Ping when nothing was sent for a heartbeat interval (under the socket lock)."""
        state = self.state
        if (
            state.heartbeat
            and state.status == "connected"
            and ping_due(now, self.conn.last_send, state.server_info)
        ):
            self.internal(Ping(), self.on_pong, first=True)

    def on_connected(self) -> None:
        """Say hello on every connection (under the socket lock, from the monitor)."""
        self.internal(hello_request(self.state.client_name), self.on_hello, first=True)

    def internal(
        self, request: Request, on_reply: Callable[[Reply], None], *, first: bool = False
    ) -> None:
        """Send a request of the client's own (hello, heartbeat); ``on_reply`` runs under the
        socket lock, in whichever thread receives the reply. It expires after the client's
        ``timeout`` like any request (nothing is retried: the next heartbeat or connection
        sends anew)."""
        state = self.state
        call_id = next(state.ids)
        future = ReplyFuture(None, time.monotonic() + state.timeout)
        call = Call(request, encode_request(call_id, request), future, False)
        call.on_reply = on_reply
        self.conn.add(call_id, call, first=first)
        state.want_background()  # nobody else waits for this reply

    def on_hello(self, reply: Reply) -> None:
        """Record the server's answer; a server not met before is announced (in this thread,
        which another thread that received the answer wakes)."""
        assert isinstance(reply, HelloReply)
        state = self.state
        previous = state.server_info
        state.server_info = reply
        if previous is None or previous.instance_id != reply.instance_id:
            self.changes.append(reply)  # on_server_change runs in this thread, unlocked
            if threading.get_ident() != self.thread_id:
                state.wake()

    def on_pong(self, reply: Reply) -> None:
        """A pong from another server instance means it restarted unnoticed: hello again."""
        assert isinstance(reply, Pong)
        info = self.state.server_info
        if info is not None and info.instance_id != reply.instance_id:  # restarted unnoticed
            self.internal(hello_request(self.state.client_name), self.on_hello, first=True)

    def new_server(self, info: HelloReply) -> None:
        """Log a server met for the first time and call ``on_server_change`` (outside the
        lock; its exceptions are logged, not raised)."""
        log.info(
            "connected to kvtrio %s at %s (instance %s)",
            info.server_version,
            self.state.endpoint,
            info.instance_id,
        )
        on_server_change = self.state.on_server_change
        if on_server_change is not None:
            try:
                on_server_change(info)
            except Exception:
                log.exception("on_server_change callback failed")
