"""The synchronous client's background thread: connection events (hello on every connect and
after a server restart), heartbeats, deadlines, and replies nobody is waiting for.

It runs in :class:`~kvtrio.client._sync.Client`'s own thread and shares that client's socket
lock; the request path never waits for it (see :mod:`kvtrio.client._sync`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from ..protocol import HelloReply, Ping, Pong, Reply, Request, encode_request
from ._common import DEFAULT_HEARTBEAT_INTERVAL, hello_request
from ._connection import Call, Connection, ReplyFuture

if TYPE_CHECKING:
    from ._sync import Client

__all__ = ["Background"]

log = logging.getLogger("kvtrio.client")


class Background:
    """The background thread's loop: connection events, heartbeats, deadlines, and replies
    nobody is waiting for."""

    def __init__(self, client: Client, conn: Connection) -> None:
        self.client = client
        self.conn = conn
        conn.on_connected = self.on_connected
        self.poller = zmq.Poller()
        self.poller.register(conn.monitor, zmq.POLLIN)
        self.poller.register(client._wake_r, zmq.POLLIN)
        self.watching = False
        self.changes: collections.deque[HelloReply] = collections.deque()

    def run(self) -> None:
        client, conn = self.client, self.conn
        while not client._closing:
            with client._socket_lock:
                now = time.monotonic()
                conn.read_monitor()
                conn.pump()
                conn.expire(now)
                self.heartbeat(now)
                conn.read_replies()  # the heartbeat's send may have consumed the socket's edge
                settled = conn.take_settled()
                timeout_ms = self.poll_timeout(now)
            if settled:
                client._settle(settled)
            while self.changes:
                self.new_server(self.changes.popleft())
            if client._outbox:
                continue
            # Watch the socket only for replies no caller is waiting for (futures with
            # callbacks); the others are received by their callers, or here at the next wake.
            if not conn.calls:
                client._io_wanted = False
            watch = client._io_wanted and client._leader is None
            if watch != self.watching:
                self.watching = client._io_watching = watch
                if watch:
                    self.poller.register(client._dealer_fd, zmq.POLLIN)
                else:
                    self.poller.unregister(client._dealer_fd)
            events = dict(self.poller.poll(timeout_ms))
            if events.get(client._wake_r):
                with contextlib.suppress(BlockingIOError):
                    os.read(client._wake_r, 65536)

    def poll_timeout(self, now: float) -> int:
        client, conn = self.client, self.conn
        if conn.unsent and client.connected:  # at the high-water mark: retry soon
            wake_at = now + 0.005
        elif client._heartbeat:
            wake_at = conn.last_send + self.heartbeat_interval()
        else:
            wake_at = now + 1
        if conn.deadlines:
            wake_at = min(wake_at, conn.deadlines[0][0])
        wake_at = min(wake_at, now + 1)
        client._io_wake_at = wake_at
        return max(0, int((wake_at - now) * 1000) + 1)

    def heartbeat_interval(self) -> float:
        info = self.client.server_info
        return info.heartbeat_timeout / 4 if info is not None else DEFAULT_HEARTBEAT_INTERVAL

    def heartbeat(self, now: float) -> None:
        client = self.client
        if (
            client._heartbeat
            and client.connected
            and now - self.conn.last_send >= self.heartbeat_interval()
        ):
            self.internal(Ping(), self.on_pong, first=True)

    def on_connected(self) -> None:
        self.internal(hello_request(self.client.client_name), self.on_hello, first=True)

    def internal(
        self, request: Request, on_reply: Callable[[Reply], None], *, first: bool = False
    ) -> None:
        """Send a request of the client's own (hello, heartbeat); ``on_reply`` runs under the
        socket lock, in whichever thread receives the reply."""
        client = self.client
        request_id = next(client._ids)
        future = ReplyFuture(None, time.monotonic() + client.timeout)
        call = Call(request, encode_request(request_id, request), future, False)
        call.on_reply = on_reply
        self.conn.add(request_id, call, first=first)
        client._want_background()  # nobody else waits for this reply

    def on_hello(self, reply: Reply) -> None:
        assert isinstance(reply, HelloReply)
        previous = self.client.server_info
        self.client.server_info = reply
        if previous is None or previous.instance_id != reply.instance_id:
            self.changes.append(reply)  # on_server_change runs in this thread, unlocked
            if threading.get_ident() != self.client._io_thread_id:
                self.client._wake()

    def on_pong(self, reply: Reply) -> None:
        assert isinstance(reply, Pong)
        info = self.client.server_info
        if info is not None and info.instance_id != reply.instance_id:  # restarted unnoticed
            self.internal(hello_request(self.client.client_name), self.on_hello, first=True)

    def new_server(self, info: HelloReply) -> None:
        log.info(
            "connected to kvtrio %s at %s (instance %s)",
            info.server_version,
            self.client.endpoint,
            info.instance_id,
        )
        if self.client._on_server_change is not None:
            try:
                self.client._on_server_change(info)
            except Exception:
                log.exception("on_server_change callback failed")
