"""The synchronous, thread-safe client for engine processes that do not run trio.

The caller does its own I/O: :meth:`Client.submit` sends the request from the calling thread
when the socket is free, and a caller that needs a reply (``future.result()``, :meth:`request`,
:meth:`Client.poll`) receives it itself. One lock guards the DEALER socket (ZeroMQ sockets may
change threads behind the full memory barrier a lock gives); whoever holds it drains the socket
and settles every reply that arrived, its own or others'. At most one waiting caller at a time
(the leader) sleeps on the socket's file descriptor; others wait on their futures. A background
thread follows the connection (monitor events, hello), sends heartbeats, expires deadlines, and
receives replies only when no caller is waiting for the socket, so the request path never waits
for it. Every future settles: with the reply, a :class:`~kvtrio.errors.ServerError`, or a client
error when its deadline passes, the connection drops, or the client closes — so
``future.result()`` never hangs.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import select
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import zmq

from ..errors import (
    ClientClosed,
    KvtrioError,
    ProtocolError,
    TransportError,
)
from ..protocol import Goodbye, HelloReply, Reply, Request, encode_request
from ..transport import check_endpoint
from ._background import Background
from ._common import (
    DEFAULT_TIMEOUT,
    GOODBYE_TIMEOUT,
    MONITOR_EVENTS,
    HandshakeWatch,
    curve_options,
    dealer_options,
)
from ._connection import Call, Connection, Outcome, ReplyFuture, settle

__all__ = ["Client"]

log = logging.getLogger("kvtrio.client")

_Rep = TypeVar("_Rep", bound=Reply)

ServerChange = Callable[[HelloReply], None]

_POLLIN = select.POLLIN


class Client:
    """A thread-safe kvtrio client; callers do their own I/O (see the module docstring).

    ``on_server_change`` is called (in the background thread; it must not block, but may submit
    requests) each time the client meets a server instance it has not seen before: on the first
    connection and after the server restarted. The server's ``hello`` answer is in
    :attr:`server_info`. A malformed ``endpoint`` raises :class:`~kvtrio.errors.TransportError`
    here, at construction. ``server_key`` / ``client_key``: CURVE credentials for ``tcp://``;
    ``insecure``: none, a plain connection to a server started with ``--insecure``
    (:func:`~kvtrio.client._common.curve_options`; missing keys are a ``ConfigError`` here).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        client_name: str = "kvtrio-client",
        on_server_change: ServerChange | None = None,
        heartbeat: bool = True,
        server_key: str | None = None,
        client_key: str | None = None,
        insecure: bool | None = None,
    ) -> None:
        self.endpoint = check_endpoint(endpoint)
        curve = curve_options(self.endpoint, server_key, client_key, insecure)
        self._options = {**dealer_options(), **curve}
        self.timeout = timeout
        self.client_name = client_name
        self.server_info: HelloReply | None = None
        self.handshake = HandshakeWatch(curve=bool(curve))
        self.handshake_error: str | None = None
        """Why the last handshake failed, if it did (:class:`HandshakeWatch`)."""
        self.state = "connecting"
        """``connecting`` (never connected yet), ``connected`` or ``disconnected``."""
        self.in_flight = 0
        """Requests sent and not answered yet (maintained under the socket lock)."""
        self._on_server_change = on_server_change
        self._heartbeat = heartbeat
        self._ids = itertools.count(1)
        self._outbox: collections.deque[tuple[int, Call]] = collections.deque()
        self._closing = False
        self._lock = threading.Lock()  # orders submit() against close()
        self._socket_lock = threading.Lock()  # the DEALER socket and self._conn
        self._lead_lock = threading.Lock()  # held by the one caller sleeping on the socket
        self._leader: int | None = None  # that caller's thread id
        self._handoff = threading.Condition(threading.Lock())  # followers wait on it
        self._followers = 0  # callers waiting while another one leads (under _handoff)
        self._lead_poller: select.poll | None = None  # the leader's, made once
        self._io_wake_at = 0.0  # when the background thread wakes next (monotonic)
        self._io_thread_id: int | None = None
        self._io_watching = False  # the background thread sleeps on the socket
        self._io_wanted = False  # a pending future has callbacks: the background must watch
        self._wake_r, self._wake_w = os.pipe()
        self._lead_r, self._lead_w = os.pipe()
        for fd in (self._wake_r, self._wake_w, self._lead_r, self._lead_w):
            os.set_blocking(fd, False)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._conn: Connection | None = None
        self._dealer_fd = -1
        self._thread = threading.Thread(target=self._run, name="kvtrio-client-io", daemon=True)
        self._started = threading.Event()
        self._start_errors: list[zmq.ZMQError] = []
        self._thread.start()
        self._started.wait()
        if self._start_errors:  # the thread has ended; nothing left to clean up
            self._close_pipes()
            error = self._start_errors[0].strerror
            raise TransportError(f"cannot connect to {endpoint}: {error}")

    # ----------------------------------------------------------------- any thread

    def submit(
        self, request: Request, *, timeout: float | None = None, fail_fast: bool = False
    ) -> Future[Reply]:
        """Send ``request`` (from this thread when the socket is free); the future settles with
        its reply or an error within ``timeout``. Its ``result()`` receives in the calling
        thread.

        With ``fail_fast``, a request made while the client is known to be disconnected fails at
        once with :class:`ServerUnavailable` instead of waiting for the connection to come back.
        """
        timeout = self.timeout if timeout is None else timeout
        request_id = next(self._ids)
        future = ReplyFuture(self, time.monotonic() + timeout)
        call = Call(request, encode_request(request_id, request), future, fail_fast)
        with self._lock:
            if self._closing:
                future.set_exception(ClientClosed("the client is closed"))
                return future
            self._outbox.append((request_id, call))
        self.poll()
        if call.deadline < self._io_wake_at:  # the background thread must expire it in time
            self._wake()
        return future

    def poll(self) -> None:
        """Make progress without waiting: send what is queued, receive and settle what arrived.

        Does nothing when another thread holds the socket (it does the same work)."""
        lock = self._socket_lock
        while True:
            if not lock.acquire(blocking=False):
                return  # the holder looks at the outbox again after releasing
            try:
                conn = self._conn
                if conn is None or conn.closed:
                    return
                conn.pump()
                settled = conn.take_settled()
            finally:
                lock.release()
            if settled:
                self._settle(settled)
            if not self._outbox:
                return

    def request(
        self, request: Request, *, timeout: float | None = None, fail_fast: bool = False
    ) -> Reply:
        """Send ``request`` and wait for its reply (see :meth:`submit` for the errors)."""
        return self.submit(request, timeout=timeout, fail_fast=fail_fast).result()

    def call(
        self,
        request: Request,
        reply_type: type[_Rep],
        *,
        timeout: float | None = None,
        fail_fast: bool = False,
    ) -> _Rep:
        """:meth:`request`, typed by the expected reply class."""
        reply = self.request(request, timeout=timeout, fail_fast=fail_fast)
        if not isinstance(reply, reply_type):  # pragma: no cover - decode_reply guarantees it
            raise ProtocolError(f"expected {reply_type.__name__}, got {type(reply).__name__}")
        return reply

    def close(self) -> None:
        """Say goodbye (the server ends the session now, not at its heartbeat timeout; at most
        ``GOODBYE_TIMEOUT``), stop the background thread; requests still pending fail with
        :class:`ClientClosed`.

        Idempotent; must not be called from the background thread (an ``on_server_change``
        callback).
        """
        if self.state == "connected" and not self._closing:
            with contextlib.suppress(KvtrioError):  # an older server: unknown_operation
                self.request(Goodbye(), timeout=GOODBYE_TIMEOUT, fail_fast=True)
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake()
        self._thread.join()
        self._close_pipes()

    @property
    def connected(self) -> bool:
        return self.state == "connected"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _close_pipes(self) -> None:
        for fd in (self._wake_r, self._wake_w, self._lead_r, self._lead_w):
            os.close(fd)

    def _wake(self) -> None:
        # A full pipe means the background thread has wakeups pending anyway.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _want_background(self) -> None:
        self._io_wanted = True
        if not self._io_watching:
            self._wake()

    def _settle(self, settled: Sequence[Outcome]) -> None:
        settle(settled)
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        """Futures were settled (or cancelled): the callers waiting for them look again."""
        if self._followers:
            with self._handoff:
                self._handoff.notify_all()
        leader = self._leader
        if leader is not None and leader != threading.get_ident():
            with contextlib.suppress(BlockingIOError, OSError):  # full: it wakes anyway
                os.write(self._lead_w, b"\0")

    def _wait(self, future: ReplyFuture, timeout: float | None) -> None:
        """Receive until ``future`` settles or ``timeout`` passes, in this thread.

        One waiting caller at a time, the leader, sleeps on the socket (its FD, edge-triggered,
        re-armed by every drain); the others, followers, wait until their future settles or
        the leader leaves, and then one of them leads. On cancellation (KeyboardInterrupt)
        leadership is handed on; nothing is lost (the reply is settled by whoever drains next).
        """
        end = None if timeout is None else time.monotonic() + timeout
        while not future.finished:
            now = time.monotonic()
            if end is not None and now >= end:
                return
            if not self._lead_lock.acquire(blocking=False):
                self._follow(future, end, now)
                continue
            try:
                self._lead(future, end)
            finally:
                self._leader = None
                self._lead_lock.release()
                if self._followers:
                    with self._handoff:
                        self._handoff.notify_all()  # one of them leads now
                if self._io_wanted:
                    self._wake()  # the background thread watches the socket again

    def _follow(self, future: ReplyFuture, end: float | None, now: float) -> None:
        """Wait while another caller leads and ``future`` is pending (at most until ``end``,
        or until just past the future's deadline, when it must have expired)."""
        limit = future.deadline + 0.001 if end is None else min(end, future.deadline + 0.001)
        with self._handoff:
            self._followers += 1
            try:
                # Checked under the condition's lock, which the leader takes to notify after
                # leaving and the settler after settling: no wake-up can be missed.
                if not future.finished and self._lead_lock.locked():
                    self._handoff.wait(limit - now)
            finally:
                self._followers -= 1

    def _lead(self, future: ReplyFuture, end: float | None) -> None:
        self._leader = threading.get_ident()
        poller = self._lead_poller
        if poller is None:  # (one leader at a time: it is used by one thread at a time)
            poller = self._lead_poller = select.poll()
            poller.register(self._dealer_fd, _POLLIN)
            poller.register(self._lead_r, _POLLIN)
        while True:
            self.poll()
            if future.finished or self._closing:
                return
            now = time.monotonic()
            wake_at = future.deadline if end is None else min(end, future.deadline)
            if now >= wake_at:
                if now >= future.deadline:  # expire it now, whoever holds the lock
                    with self._socket_lock:
                        if self._conn is not None and not self._conn.closed:
                            self._conn.expire(now)
                            settled = self._conn.take_settled()
                        else:
                            settled = ()
                    self._settle(settled)
                    continue
                return
            events = poller.poll(max(1, int((wake_at - now) * 1000) + 1))
            for fd, _ in events:
                if fd == self._lead_r:
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.read(self._lead_r, 4096)

    # ----------------------------------------------------------------- the background thread

    def _log_warning(self, failure: str) -> None:
        log.warning("%s: %s", self.endpoint, failure)

    def _log_lost(self) -> None:
        log.info("lost connection to %s", self.endpoint)

    def _run(self) -> None:
        self._io_thread_id = threading.get_ident()
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        for option, value in self._options.items():
            dealer.setsockopt(option, value)
        monitor = self._context.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor_endpoint = f"inproc://kvtrio-client-monitor-{uuid.uuid4().hex}"  # never reused
        dealer.monitor(monitor_endpoint, MONITOR_EVENTS)
        monitor.connect(monitor_endpoint)
        conn = Connection(self, dealer, monitor)
        try:
            try:
                dealer.connect(self.endpoint)
            except zmq.ZMQError as exc:  # check_endpoint let through what libzmq refuses
                self._start_errors.append(exc)
                return
            finally:
                self._dealer_fd = int(dealer.getsockopt(zmq.FD))
                self._conn = conn
                self._started.set()
            Background(self, conn).run()
        except BaseException:  # pragma: no cover - a bug; never leave futures hanging
            log.exception("kvtrio client background thread failed")
            raise
        finally:
            self._closing = True
            with self._socket_lock:
                conn.take_outbox()
                for call in conn.calls.values():
                    conn.fail(call, ClientClosed("the client was closed"))
                conn.closed = True
                settled = conn.take_settled()
                dealer.disable_monitor()  # before closing its reader: see transport.open_monitor
                monitor.close(linger=0)
                dealer.close(linger=0)
            self._settle(settled)
