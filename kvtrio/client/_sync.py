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

What the threads share is one :class:`~kvtrio.client._state.ClientState`; the socket and its
calls are a :class:`~kvtrio.client._connection.Connection`; the background thread's loop is
:class:`~kvtrio.client._background.Background`. This module is the callers' side.
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TypeVar

import zmq

from ..errors import (
    ClientClosed,
    KvtrioError,
    ProtocolError,
    TransportError,
)
from ..protocol import Goodbye, HelloReply, Reply, Request, encode_request, prepare_hooks
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
from ._connection import Connection
from ._placement import INHERITED, ThreadPlacement
from ._state import Call, ClientState, Outcome, ReplyFuture, ServerChange

__all__ = ["Client"]

log = logging.getLogger("kvtrio.client")

_Rep = TypeVar("_Rep", bound=Reply)

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
    ``placement``: where the client's I/O thread runs (:class:`ThreadPlacement`).
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
        placement: ThreadPlacement = INHERITED,
    ) -> None:
        checked = check_endpoint(endpoint)
        prepare_hooks()  # (not at an engine's first request: cattrs' code generation)
        self._placement = placement
        curve = curve_options(checked, server_key, client_key, insecure)
        self._options = {**dealer_options(), **curve}
        self._met = threading.Event()  # set at the first server's hello answer
        self._on_server_change = on_server_change
        self._shared = ClientState(
            endpoint=checked,
            timeout=timeout,
            client_name=client_name,
            heartbeat=heartbeat,
            on_server_change=self._server_met,
            handshake=HandshakeWatch(curve=bool(curve)),
            wait=self._wait,
        )
        self._lock = threading.Lock()  # orders submit() against close()
        self._lead_lock = threading.Lock()  # held by the one caller sleeping on the socket
        self._lead_poller: select.poll | None = None  # the leader's, made once
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._conn: Connection | None = None
        self._thread = threading.Thread(target=self._run, name="kvtrio-client-io", daemon=True)
        self._started = threading.Event()
        self._start_errors: list[zmq.ZMQError] = []
        self._thread.start()
        self._started.wait()
        if self._start_errors:  # the thread has ended; nothing left to clean up
            self._shared.close_pipes()
            error = self._start_errors[0].strerror
            raise TransportError(f"cannot connect to {endpoint}: {error}")

    # ----------------------------------------------------------------- what the client knows

    @property
    def endpoint(self) -> str:
        """The server's address, as checked at construction."""
        return self._shared.endpoint

    @property
    def timeout(self) -> float:
        """Seconds a request waits for its reply unless told otherwise."""
        return self._shared.timeout

    @property
    def client_name(self) -> str:
        """The name this client gives the server in its ``hello``."""
        return self._shared.client_name

    @property
    def server_info(self) -> HelloReply | None:
        """The server's last ``hello`` answer (``None`` until the first one)."""
        return self._shared.server_info

    @property
    def handshake(self) -> HandshakeWatch:
        """What the connection's handshakes did so far (see :attr:`handshake_error`)."""
        return self._shared.handshake

    @property
    def handshake_error(self) -> str | None:
        """Why the last handshake failed, if it did (:class:`HandshakeWatch`)."""
        return self._shared.handshake_error

    @property
    def state(self) -> str:
        """``connecting`` (never connected yet), ``connected`` or ``disconnected``."""
        return self._shared.status

    @property
    def in_flight(self) -> int:
        """Requests sent and not answered yet (maintained under the socket lock)."""
        return self._shared.in_flight

    @property
    def connected(self) -> bool:
        """The connection is up (the handshake succeeded and it has not dropped since)."""
        return self._shared.status == "connected"

    def known_away(self) -> bool:
        """The server is known to be away: the last connection attempt failed or the connection
        dropped, and no handshake is waiting for its verdict (what fails ``fail_fast``
        requests). Not while the first connection is still being made (``connecting``)."""
        shared = self._shared
        return shared.status == "disconnected" and not shared.handshake.undecided

    def wait_for_server(
        self, timeout: float, *, while_away: bool = False, hello: bool = True
    ) -> bool:
        """Wait (blocking, at most ``timeout`` seconds) until the server has answered this
        client's ``hello`` (:attr:`server_info`; without ``hello``: until the connection is
        up); True if it has. False when the time passed, and at once when the server is
        :meth:`known_away` (``while_away``: keep waiting for one that is starting, as ZeroMQ
        reconnects every 0.1–1 s) or, in any case, refused this client's handshake for good (a
        key problem: see :attr:`handshake_error`). Interrupted (KeyboardInterrupt), nothing
        changes."""
        end = time.monotonic() + timeout
        shared = self._shared
        while True:
            if shared.server_info is not None or (not hello and shared.status == "connected"):
                return True
            if not while_away and self.known_away():
                return False
            if shared.handshake_error is not None and not shared.handshake.undecided:
                return False  # (cleared by a handshake that succeeds)
            left = end - time.monotonic()
            if left <= 0 or shared.closing:
                return False
            # Woken by the hello's answer; the status and the handshake are looked at again
            # every 20 ms (a refused connection is reported within a few).
            self._met.wait(min(left, 0.02))

    def _server_met(self, info: HelloReply) -> None:
        """A server instance not met before answered ``hello`` (background thread): wake
        :meth:`wait_for_server`, then call the caller's ``on_server_change``."""
        self._met.set()
        if self._on_server_change is not None:
            self._on_server_change(info)

    # ----------------------------------------------------------------- any thread

    def submit(
        self, request: Request, *, timeout: float | None = None, fail_fast: bool = False
    ) -> Future[Reply]:
        """Send ``request`` (from this thread when the socket is free); the future settles with
        its reply or an error within ``timeout`` (``RequestTimeout`` if sent, else
        ``ServerUnavailable``). Its ``result()`` receives in the calling thread. Never waits
        for the reply, nor for the socket (when another thread holds it, that one sends).

        With ``fail_fast``, a request made while the client is known to be disconnected fails at
        once with :class:`ServerUnavailable` instead of waiting for the connection to come back.
        Interrupted (KeyboardInterrupt) after queueing the request, it is still sent and
        settled; the caller just has no future for it.
        """
        shared = self._shared
        timeout = shared.timeout if timeout is None else timeout
        call_id = next(shared.ids)
        future = ReplyFuture(shared, time.monotonic() + timeout)
        call = Call(request, encode_request(call_id, request), future, fail_fast)
        with self._lock:
            if shared.closing:
                future.set_exception(ClientClosed("the client is closed"))
                return future
            shared.outbox.append((call_id, call))
        self.poll()
        if call.deadline < shared.background_wakes_at:  # the background must expire it in time
            shared.wake()
        return future

    def poll(self) -> None:
        """Make progress without waiting: send what is queued, receive and settle what arrived.

        Does nothing when another thread holds the socket (it does the same work). Done
        callbacks of what settles run here, in this thread. Never blocks, so no timeout; a
        KeyboardInterrupt while it holds the lock can lose a call (see ``Connection``)."""
        shared = self._shared
        lock = shared.socket_lock
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
                shared.settle(settled)
            if not shared.outbox:
                return

    def request(
        self, request: Request, *, timeout: float | None = None, fail_fast: bool = False
    ) -> Reply:
        """Send ``request`` and wait for its reply (see :meth:`submit` for the errors).
        Interrupted (KeyboardInterrupt), the request stays in flight and settles unseen."""
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
        callback). Interrupted during the goodbye, the client stays open (call it again);
        during the join, the background thread still ends and settles everything, but the
        wake pipes stay open.
        """
        shared = self._shared
        if shared.status == "connected" and not shared.closing:
            with contextlib.suppress(KvtrioError):  # an older server: unknown_operation
                self.request(Goodbye(), timeout=GOODBYE_TIMEOUT, fail_fast=True)
        with self._lock:
            if shared.closing:
                return
            shared.closing = True
        shared.wake()
        self._thread.join()
        shared.close_pipes()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- a caller waiting

    def _wait(self, future: ReplyFuture, timeout: float | None) -> None:
        """Receive until ``future`` settles or ``timeout`` passes, in this thread (what
        ``future.result()`` runs, as :attr:`ClientState.wait`).

        One waiting caller at a time, the leader, sleeps on the socket (its FD, edge-triggered,
        re-armed by every drain); the others, followers, wait until their future settles or
        the leader leaves, and then one of them leads. On cancellation (KeyboardInterrupt)
        leadership is handed on; nothing is lost (the reply is settled by whoever drains next).
        """
        shared = self._shared
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
                shared.leader = None
                self._lead_lock.release()
                if shared.followers:
                    with shared.handoff:
                        shared.handoff.notify_all()  # one of them leads now
                if shared.background_wanted:
                    shared.wake()  # the background thread watches the socket again

    def _follow(self, future: ReplyFuture, end: float | None, now: float) -> None:
        """Wait while another caller leads and ``future`` is pending (at most until ``end``,
        or until just past the future's deadline, when it must have expired)."""
        shared = self._shared
        limit = future.deadline + 0.001 if end is None else min(end, future.deadline + 0.001)
        with shared.handoff:
            shared.followers += 1
            try:
                # Checked under the condition's lock, which the leader takes to notify after
                # leaving and the settler after settling: no wake-up can be missed.
                if not future.finished and self._lead_lock.locked():
                    shared.handoff.wait(limit - now)
            finally:
                shared.followers -= 1

    def _lead(self, future: ReplyFuture, end: float | None) -> None:
        """Drive the socket until ``future`` settles, ``end`` passes or the client closes:
        poll, and sleep on the socket's FD and the leader's pipe (settlers in other threads
        write it); at the future's deadline expire it here, whoever holds the lock."""
        shared = self._shared
        shared.leader = threading.get_ident()
        poller = self._lead_poller
        if poller is None:  # (one leader at a time: it is used by one thread at a time)
            assert self._conn is not None  # (set before the constructor returns)
            poller = self._lead_poller = select.poll()
            poller.register(self._conn.dealer_fd, _POLLIN)
            poller.register(shared.lead_r, _POLLIN)
        while True:
            self.poll()
            if future.finished or shared.closing:
                return
            now = time.monotonic()
            wake_at = future.deadline if end is None else min(end, future.deadline)
            if now >= wake_at:
                if now >= future.deadline:  # expire it now, whoever holds the lock
                    self._settle_expired(now)
                    continue
                return
            events = poller.poll(max(1, int((wake_at - now) * 1000) + 1))
            for fd, _ in events:
                if fd == shared.lead_r:
                    shared.take_lead_wakeups()

    def _settle_expired(self, now: float) -> None:
        """Expire what is due (waiting for the socket lock) and settle it."""
        settled: Sequence[Outcome] = ()
        with self._shared.socket_lock:
            conn = self._conn
            if conn is not None and not conn.closed:
                conn.expire(now)
                settled = conn.take_settled()
        self._shared.settle(settled)

    # ----------------------------------------------------------------- the background thread

    def _run(self) -> None:
        """The background thread: open the sockets, connect, run :class:`Background` until the
        client closes; then fail what is still pending with ``ClientClosed``."""
        self._placement.apply()
        shared = self._shared
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        for option, value in self._options.items():
            dealer.setsockopt(option, value)
        monitor = self._context.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor_endpoint = f"inproc://kvtrio-client-monitor-{uuid.uuid4().hex}"  # never reused
        dealer.monitor(monitor_endpoint, MONITOR_EVENTS)
        monitor.connect(monitor_endpoint)
        conn = Connection(shared, dealer, monitor)
        try:
            try:
                dealer.connect(shared.endpoint)
            except zmq.ZMQError as exc:  # check_endpoint let through what libzmq refuses
                self._start_errors.append(exc)
                return
            finally:
                self._conn = conn
                self._started.set()
            Background(shared, conn).run()
        except BaseException:  # pragma: no cover - a bug; never leave futures hanging
            log.exception("kvtrio client background thread failed")
            raise
        finally:
            shared.closing = True
            with shared.socket_lock:
                conn.close(ClientClosed("the client was closed"))
                settled = conn.take_settled()
            shared.settle(settled)
