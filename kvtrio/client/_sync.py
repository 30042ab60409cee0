"""The synchronous, thread-safe client for engine processes that do not run trio.

A background I/O thread owns the DEALER socket (ZeroMQ sockets must stay in one thread). Any
thread calls :meth:`Client.submit` and gets a :class:`concurrent.futures.Future`; the I/O thread
sends the request, matches the reply by id, and settles the future. Every future settles: with
the reply, a :class:`~kvtrio.errors.ServerError`, or a client error when its deadline passes, the
connection drops, or the client closes — so ``future.result()`` never hangs.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import (
    ClientClosed,
    ConnectionLost,
    KvtrioError,
    ProtocolError,
    RequestTimeout,
    ServerUnavailable,
    TransportError,
)
from ..protocol import Goodbye, HelloReply, Ping, Pong, Reply, Request, encode_request
from ..transport import check_endpoint
from ._common import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_TIMEOUT,
    GOODBYE_TIMEOUT,
    MONITOR_EVENTS,
    curve_options,
    dealer_options,
    handshake_failure,
    hello_request,
    read_reply_header,
    reply_or_error,
)

__all__ = ["Client"]

log = logging.getLogger("kvtrio.client")

_Rep = TypeVar("_Rep", bound=Reply)

ServerChange = Callable[[HelloReply], None]


class _Call:
    __slots__ = ("deadline", "fail_fast", "frames", "future", "request_type", "sent")

    def __init__(
        self, request: Request, frames: list[bytes], deadline: float, fail_fast: bool
    ) -> None:
        self.request_type = type(request)
        self.frames = frames
        self.deadline = deadline
        self.fail_fast = fail_fast
        self.future: Future[Reply] = Future()
        self.sent = False


class Client:
    """A thread-safe kvtrio client with its own I/O thread.

    ``on_server_change`` is called (in the I/O thread; it must not block, but may submit
    requests) each time the client meets a server instance it has not seen before: on the first
    connection and after the server restarted. The server's ``hello`` answer is in
    :attr:`server_info`. A malformed ``endpoint`` raises :class:`~kvtrio.errors.TransportError`
    here, at construction.
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
    ) -> None:
        self.endpoint = check_endpoint(endpoint)
        self._options = {**dealer_options(), **curve_options(self.endpoint, server_key, client_key)}
        self.timeout = timeout
        self.client_name = client_name
        self.server_info: HelloReply | None = None
        self.handshake_error: str | None = None
        """Why the last handshake failed (CURVE), if it did."""
        self.state = "connecting"
        """``connecting`` (never connected yet), ``connected`` or ``disconnected``."""
        self.in_flight = 0
        """Requests sent and not answered yet (maintained by the I/O thread)."""
        self._on_server_change = on_server_change
        self._heartbeat = heartbeat
        self._ids = itertools.count(1)
        self._outbox: collections.deque[tuple[int, _Call]] = collections.deque()
        self._closing = False
        self._lock = threading.Lock()  # orders submit() against close()
        self._io_idle = False  # the I/O thread is (about to be) asleep in poll
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._thread = threading.Thread(target=self._run, name="kvtrio-client-io", daemon=True)
        self._started = threading.Event()
        self._start_errors: list[zmq.ZMQError] = []
        self._thread.start()
        self._started.wait()
        if self._start_errors:  # the thread has ended; nothing left to clean up
            os.close(self._wake_r)
            os.close(self._wake_w)
            error = self._start_errors[0].strerror
            raise TransportError(f"cannot connect to {endpoint}: {error}")

    # ----------------------------------------------------------------- any thread

    def submit(
        self, request: Request, *, timeout: float | None = None, fail_fast: bool = False
    ) -> Future[Reply]:
        """Queue ``request``; the future settles with its reply or an error within ``timeout``.

        With ``fail_fast``, a request made while the client is known to be disconnected fails at
        once with :class:`ServerUnavailable` instead of waiting for the connection to come back.
        """
        timeout = self.timeout if timeout is None else timeout
        request_id = next(self._ids)
        call = _Call(
            request, encode_request(request_id, request), time.monotonic() + timeout, fail_fast
        )
        with self._lock:
            if self._closing:
                call.future.set_exception(ClientClosed("the client is closed"))
                return call.future
            self._outbox.append((request_id, call))
        if self._io_idle:  # see _IOLoop.wait for why no wakeup is lost
            self._wake()
        return call.future

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
        ``GOODBYE_TIMEOUT``), stop the I/O thread; requests still pending fail with
        :class:`ClientClosed`.

        Idempotent; must not be called from the I/O thread (an ``on_server_change`` callback).
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
        os.close(self._wake_r)
        os.close(self._wake_w)

    @property
    def connected(self) -> bool:
        return self.state == "connected"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _wake(self) -> None:
        # A full pipe means the I/O thread has wakeups pending anyway.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    # ----------------------------------------------------------------- the I/O thread

    def _run(self) -> None:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        for option, value in self._options.items():
            dealer.setsockopt(option, value)
        monitor = self._context.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor_endpoint = f"inproc://kvtrio-client-monitor-{uuid.uuid4().hex}"  # never reused
        dealer.monitor(monitor_endpoint, MONITOR_EVENTS)
        monitor.connect(monitor_endpoint)
        try:
            try:
                dealer.connect(self.endpoint)
            except zmq.ZMQError as exc:  # check_endpoint let through what libzmq refuses
                self._start_errors.append(exc)
                return
            finally:
                self._started.set()
            _IOLoop(self, dealer, monitor).run()
        except BaseException:  # pragma: no cover - a bug; never leave futures hanging
            log.exception("kvtrio client I/O thread failed")
            raise
        finally:
            self._closing = True
            dealer.disable_monitor()  # before closing its reader: see transport.open_monitor
            monitor.close(linger=0)
            dealer.close(linger=0)


class _IOLoop:
    """The I/O thread's state and loop (only ever touched by that thread)."""

    def __init__(
        self, client: Client, dealer: zmq.Socket[bytes], monitor: zmq.Socket[bytes]
    ) -> None:
        self.client = client
        self.dealer = dealer
        self.monitor = monitor
        self.calls: dict[int, _Call] = {}
        self.unsent: collections.deque[tuple[int, _Call]] = collections.deque()
        self.deadlines: list[tuple[float, int]] = []
        self.last_send = time.monotonic()
        self.poller = zmq.Poller()
        self.watching_out = False
        self.poller.register(dealer, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)
        self.poller.register(client._wake_r, zmq.POLLIN)

    def run(self) -> None:
        client = self.client
        while not client._closing:
            self.take_outbox()
            self.flush()
            now = time.monotonic()
            self.expire(now)
            self.heartbeat(now)
            events = self.wait(self.poll_timeout(now))
            if events.get(client._wake_r):
                with contextlib.suppress(BlockingIOError):
                    os.read(client._wake_r, 65536)
            if events.get(self.monitor):
                self.read_monitor()
            if events.get(self.dealer):
                self.read_replies()
        self.take_outbox()
        for call in self.calls.values():
            _settle_error(call, ClientClosed("the client was closed"))

    def pop(self, request_id: int) -> _Call | None:
        """Forget a call (answered, expired or failed); keeps ``Client.in_flight`` exact."""
        call = self.calls.pop(request_id, None)
        if call is not None and call.sent:
            self.client.in_flight -= 1
        return call

    def wait(self, timeout_ms: int) -> dict[Any, int]:
        """Poll the sockets and the wakeup pipe.

        Callers write to the pipe only while ``_io_idle`` is set, which saves a write and a
        read per request while this thread is busy. No wakeup is lost: the flag is set *before*
        the outbox is checked one last time, and a caller appends to the outbox *before* it
        reads the flag, so either this check sees the new request or the caller sees the flag.
        """
        client = self.client
        client._io_idle = True
        try:
            if client._outbox:
                timeout_ms = 0
            return dict(self.poller.poll(timeout_ms))
        finally:
            client._io_idle = False

    def poll_timeout(self, now: float) -> int:
        # Requests left unsent while connected means the socket is at its high-water mark:
        # wait for writability then (not while disconnected: the socket would always say yes).
        watch_out = bool(self.unsent) and self.client.connected
        if watch_out != self.watching_out:
            self.watching_out = watch_out
            self.poller.register(self.dealer, zmq.POLLIN | (zmq.POLLOUT if watch_out else 0))
        wake_at = self.last_send + self.heartbeat_interval() if self.client._heartbeat else now + 1
        if self.deadlines:
            wake_at = min(wake_at, self.deadlines[0][0])
        return max(0, min(1000, int((wake_at - now) * 1000) + 1))

    def heartbeat_interval(self) -> float:
        info = self.client.server_info
        return info.heartbeat_timeout / 4 if info is not None else DEFAULT_HEARTBEAT_INTERVAL

    def take_outbox(self) -> None:
        outbox = self.client._outbox
        while outbox:
            request_id, call = outbox.popleft()
            if call.future.cancelled():
                continue
            if call.fail_fast and self.client.state == "disconnected":
                _settle_error(
                    call,
                    ServerUnavailable(
                        _unreachable(self.client.endpoint, self.client.handshake_error)
                    ),
                )
                continue
            self.calls[request_id] = call
            heapq.heappush(self.deadlines, (call.deadline, request_id))
            self.unsent.append((request_id, call))

    def flush(self) -> None:
        """Send queued requests while the connection is up (see ``dealer_options``)."""
        while self.unsent and self.client.connected:
            request_id, call = self.unsent[0]
            if request_id not in self.calls:  # expired while waiting to be sent
                self.unsent.popleft()
                continue
            try:
                self.dealer.send_multipart(call.frames, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.unsent.popleft()
            call.sent = True
            self.client.in_flight += 1
            call.frames = []
            self.last_send = time.monotonic()

    def expire(self, now: float) -> None:
        while self.deadlines and self.deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self.deadlines)
            call = self.pop(request_id)
            if call is None:
                continue
            endpoint = self.client.endpoint
            if call.sent:
                error: KvtrioError = RequestTimeout(
                    f"no reply to {call.request_type.op!r} from {endpoint} in time"
                )
            else:
                error = ServerUnavailable(_unreachable(endpoint))
            _settle_error(call, error)

    def heartbeat(self, now: float) -> None:
        client = self.client
        if (
            client._heartbeat
            and client.connected
            and now - self.last_send >= self.heartbeat_interval()
        ):
            self.internal(Ping(), self.on_pong)

    def internal(self, request: Request, on_reply: Callable[[Reply], None]) -> None:
        """Send a request of the client's own (hello, heartbeat) handled in this thread."""
        request_id = next(self.client._ids)
        call = _Call(
            request,
            encode_request(request_id, request),
            time.monotonic() + self.client.timeout,
            False,
        )

        def done(future: Future[Reply]) -> None:
            if not future.cancelled() and future.exception() is None:
                on_reply(future.result())

        call.future.add_done_callback(done)
        self.calls[request_id] = call
        heapq.heappush(self.deadlines, (call.deadline, request_id))
        self.unsent.appendleft((request_id, call))
        self.flush()

    def read_replies(self) -> None:
        while True:
            try:
                frames = self.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            header = read_reply_header(frames)
            call = self.pop(header.request_id) if header is not None else None
            if header is None or call is None:
                continue
            if call.future.cancelled():
                continue
            try:
                result = reply_or_error(header, frames[1], call.request_type)
            except ProtocolError as exc:
                _settle_error(call, exc)
                continue
            if isinstance(result, Exception):
                _settle_error(call, result)
            elif call.future.set_running_or_notify_cancel():
                call.future.set_result(result)

    def read_monitor(self) -> None:
        client = self.client
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            failure = handshake_failure(event)
            if failure is not None and failure != client.handshake_error:
                log.warning("%s: %s", client.endpoint, failure)
            if failure is not None or event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                client.handshake_error = failure  # kept through the disconnections that follow
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                client.state = "connected"
                self.internal(hello_request(client.client_name), self.on_hello)
                continue
            if client.connected:
                log.info("lost connection to %s", client.endpoint)
            client.state = "disconnected"
            self.fail_unsent_fail_fast()
            if event == zmq.EVENT_DISCONNECTED:
                self.read_replies()  # replies that arrived before the close are still good
                for request_id, call in list(self.calls.items()):
                    if call.sent:
                        self.pop(request_id)
                        _settle_error(call, ConnectionLost(f"connection to {client.endpoint} lost"))

    def unreachable(self) -> str:
        return _unreachable(self.client.endpoint, self.client.handshake_error)

    def fail_unsent_fail_fast(self) -> None:
        """Requests that may not wait for a connection fail once the server is known down."""
        for request_id, call in list(self.calls.items()):
            if call.fail_fast and not call.sent:
                self.pop(request_id)
                _settle_error(
                    call,
                    ServerUnavailable(
                        _unreachable(self.client.endpoint, self.client.handshake_error)
                    ),
                )

    def on_hello(self, reply: Reply) -> None:
        assert isinstance(reply, HelloReply)
        previous = self.client.server_info
        self.client.server_info = reply
        if previous is None or previous.instance_id != reply.instance_id:
            self.new_server(reply)

    def on_pong(self, reply: Reply) -> None:
        assert isinstance(reply, Pong)
        info = self.client.server_info
        if info is not None and info.instance_id != reply.instance_id:  # restarted unnoticed
            self.internal(hello_request(self.client.client_name), self.on_hello)

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


def _settle_error(call: _Call, error: BaseException) -> None:
    if call.future.set_running_or_notify_cancel():
        call.future.set_exception(error)


def _unreachable(endpoint: str, handshake_error: str | None = None) -> str:
    if handshake_error is not None:
        return f"cannot reach {endpoint}: {handshake_error}"
    return f"cannot reach {endpoint} (no connection; is the server running?)"
