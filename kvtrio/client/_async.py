"""The trio client: many concurrent requests over one DEALER socket, replies matched by id."""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import NoReturn, TypeVar, cast

import outcome
import trio
import zmq

from ..errors import (
    ClientClosed,
    ConnectionLost,
    KvtrioError,
    ProtocolError,
    RequestTimeout,
    ServerError,
    ServerUnavailable,
)
from ..protocol import Goodbye, HelloReply, Ping, Reply, Request, encode_request
from ..transport import Monitor, Socket, check_endpoint, open_monitor, open_socket
from ._common import (
    DEFAULT_TIMEOUT,
    GOODBYE_TIMEOUT,
    MONITOR_EVENTS,
    HandshakeWatch,
    curve_options,
    dealer_options,
    heartbeat_interval,
    hello_request,
    ping_due,
    read_reply_header,
    reply_or_error,
)

__all__ = ["AsyncClient", "open_client"]

log = logging.getLogger("kvtrio.client")

_Rep = TypeVar("_Rep", bound=Reply)


class _Call:
    """A request in flight: its reply (or error) once settled, and the task waiting for it."""

    __slots__ = ("request_type", "result", "sent", "task")

    def __init__(self, request_type: type[Request]) -> None:
        self.request_type = request_type
        self.sent = False
        self.result: outcome.Outcome[Reply] | None = None
        self.task: trio.lowlevel.Task | None = None

    def settle(self, result: outcome.Outcome[Reply]) -> None:
        if self.result is None:
            self.result = result
            if self.task is not None:
                trio.lowlevel.reschedule(self.task)
                self.task = None

    async def wait(self) -> None:
        """Wait until settled (cancellation: stops waiting; the call may still settle)."""
        if self.result is not None:
            await trio.lowlevel.checkpoint()
            return
        self.task = trio.lowlevel.current_task()

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            self.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


class AsyncClient:
    """A kvtrio client for trio code. Create it with :func:`open_client`.

    Any number of tasks may call :meth:`request` concurrently. On every (re)connection the
    client says ``hello`` by itself and keeps the answer in :attr:`server_info`.
    """

    def __init__(
        self, socket: Socket, endpoint: str, timeout: float, client_name: str, curve: bool = False
    ) -> None:
        self._socket = socket
        self.endpoint = endpoint
        self.handshake = HandshakeWatch(curve)
        self.handshake_error: str | None = None
        """Why the last handshake failed, if it did (:class:`HandshakeWatch`)."""
        self.timeout = timeout
        self.client_name = client_name
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._closed = False
        self.connected = False
        self.server_info: HelloReply | None = None
        self._last_send = trio.current_time()
        self._connected_event = trio.Event()  # set once, after the first hello
        self._up = trio.Event()  # set while the connection is up; replaced when it drops

    async def request(self, request: Request, *, timeout: float | None = None) -> Reply:
        """Send ``request`` and return its reply.

        Raises :class:`ServerError` (the subclass for the error code) for an error reply,
        :class:`RequestTimeout` if no reply came in time, :class:`ServerUnavailable` if it could
        not even be sent in time, :class:`ConnectionLost` if the connection dropped meanwhile,
        :class:`ClientClosed` if the client closed. Cancellation abandons the request (a late
        reply is discarded).
        """
        if self._closed:
            raise ClientClosed("the client is closed")
        timeout = self.timeout if timeout is None else timeout
        call_id = next(self._ids)
        call = _Call(type(request))
        self._calls[call_id] = call
        try:
            with trio.move_on_after(timeout):
                if not self._up.is_set():
                    await self._up.wait()  # never queue a request for a connection that is down
                    if self._closed:  # (woken by the close)
                        raise ClientClosed("the client was closed")
                frames = encode_request(call_id, request)
                # No scheduling round for the send when the socket takes it at once (at the
                # high-water mark it waits); the wait for the reply is this call's checkpoint.
                if not self._socket.try_send_multipart(frames):
                    await self._socket.send_multipart(frames)
                call.sent = True
                self._last_send = trio.current_time()
                await call.wait()
        except trio.ClosedResourceError:
            raise ClientClosed("the client is closed") from None
        finally:
            self._calls.pop(call_id, None)
        if call.result is None:
            if not call.sent:
                why = f": {self.handshake_error}" if self.handshake_error else ""
                raise ServerUnavailable(f"could not reach {self.endpoint} within {timeout}s{why}")
            raise RequestTimeout(
                f"no reply to {request.op!r} from {self.endpoint} within {timeout}s"
            )
        return call.result.unwrap()

    async def call(
        self, request: Request, reply_type: type[_Rep], *, timeout: float | None = None
    ) -> _Rep:
        """:meth:`request`, checking that the reply is a ``reply_type``."""
        reply = await self.request(request, timeout=timeout)
        if not isinstance(reply, reply_type):  # pragma: no cover - decode_reply guarantees it
            raise ProtocolError(f"expected {reply_type.__name__}, got {type(reply).__name__}")
        return reply

    async def wait_connected(self) -> None:
        """Wait until the client has connected (and said hello) at least once."""
        await self._connected_event.wait()

    # ----------------------------------------------------------------- background tasks

    async def _receive_replies(self) -> NoReturn:
        # This task owns the socket's edge (no pump): a reply wakes it, it delivers, the
        # requester runs; two scheduling rounds per request. Replies are taken and delivered
        # with no checkpoint in between, so that when the connection drops no reply is held by
        # this task while the monitor task fails the calls in flight.
        await self._socket.serve_edge(self._drain)

    def _drain(self) -> bool:
        socket = self._socket
        while (frames := socket.try_recv_multipart()) is not None:
            self._deliver(frames)
        return False

    def _deliver(self, frames: list[bytes]) -> None:
        """Settle the call a reply answers (late replies and garbage are ignored)."""
        header = read_reply_header(frames)
        call = self._calls.get(header[0]) if header is not None else None
        if header is None or call is None:
            return
        try:
            result: Reply | ServerError = reply_or_error(header[1], frames[1], call.request_type)
        except ProtocolError as exc:
            call.settle(outcome.Error(exc))
            return
        if isinstance(result, ServerError):
            call.settle(outcome.Error(result))
        else:
            call.settle(outcome.Value(result))

    async def _follow_connection(self, monitor: Monitor, nursery: trio.Nursery) -> None:
        while True:
            event, value = await monitor.receive_event()
            failure = self.handshake.observe(event, value)
            if failure is not None:
                log.warning("%s: %s", self.endpoint, failure)
            self.handshake_error = self.handshake.error  # kept through disconnections
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                self._up.set()
                nursery.start_soon(self._say_hello)
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                if self.connected:
                    log.info("lost connection to %s", self.endpoint)
                self.connected = False
                if self._up.is_set():
                    self._up = trio.Event()
                # Replies that arrived before the connection closed are still good.
                while (frames := self._socket.try_recv_multipart()) is not None:
                    self._deliver(frames)
                self._fail_sent()

    async def _say_hello(self) -> None:
        try:
            info = await self.request(hello_request(self.client_name))
        except ClientClosed:
            return
        except KvtrioError as exc:
            log.warning("hello to %s failed: %s", self.endpoint, exc)
            return
        self.server_info = cast(HelloReply, info)
        self._connected_event.set()

    async def _heartbeat(self) -> None:
        """Ping whenever nothing was sent for a quarter of the server's heartbeat timeout."""
        await self._connected_event.wait()
        while True:
            if not self._up.is_set():  # (nothing is sent meanwhile: the ping would be due, always)
                await self._up.wait()
            interval = heartbeat_interval(self.server_info)
            await trio.sleep_until(self._last_send + interval)
            if ping_due(trio.current_time(), self._last_send, self.server_info) and self.connected:
                with suppress(KvtrioError):
                    await self.request(Ping(), timeout=interval)

    def _fail_sent(self) -> None:
        for call in list(self._calls.values()):
            if call.sent:
                call.settle(outcome.Error(ConnectionLost(f"connection to {self.endpoint} lost")))

    def _close(self) -> None:
        self._closed = True
        self._up.set()  # (the requests waiting for a connection end now, not at their timeout)
        for call in list(self._calls.values()):
            call.settle(outcome.Error(ClientClosed("the client was closed")))


@asynccontextmanager
async def open_client(
    endpoint: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    client_name: str = "kvtrio-async-client",
    heartbeat: bool = True,
    server_key: str | None = None,
    client_key: str | None = None,
    insecure: bool | None = None,
) -> AsyncIterator[AsyncClient]:
    """Connect to a kvtrio server for the duration of the block.

    Connecting happens in the background (and again after every disconnection); requests made
    before the connection is up wait for it, within their timeout. With ``heartbeat``, an idle
    client pings the server so its session stays alive. A malformed ``endpoint`` raises
    :class:`~kvtrio.errors.TransportError` before anything is opened. ``server_key`` /
    ``client_key``: CURVE credentials for ``tcp://``; ``insecure``: none, a plain connection to
    a server started with ``--insecure`` (see :func:`~kvtrio.client._common.curve_options`).
    """
    endpoint = check_endpoint(endpoint)
    options = {**dealer_options(), **curve_options(endpoint, server_key, client_key, insecure)}
    async with (
        open_socket(zmq.DEALER, options=options, pump=False) as socket,
        open_monitor(socket, MONITOR_EVENTS) as monitor,
        trio.open_nursery() as nursery,
    ):
        client = AsyncClient(
            socket, endpoint, timeout, client_name, curve=zmq.CURVE_SERVERKEY in options
        )
        nursery.start_soon(client._receive_replies)
        nursery.start_soon(client._follow_connection, monitor, nursery)
        if heartbeat:
            nursery.start_soon(client._heartbeat)
        socket.connect(endpoint)
        try:
            yield client
        finally:
            if client.connected and not client._closed:
                with trio.move_on_after(GOODBYE_TIMEOUT) as goodbye:
                    goodbye.shield = True  # also when the block was cancelled: bounded
                    with suppress(KvtrioError):
                        await client.request(Goodbye(), timeout=GOODBYE_TIMEOUT)
            client._close()
            nursery.cancel_scope.cancel()
