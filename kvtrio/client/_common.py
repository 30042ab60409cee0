"""What the trio client and the synchronous client share: socket options, reply decoding."""

from __future__ import annotations

import os
from typing import Any

import zmq

from .._version import __version__
from ..errors import ProtocolError, ServerError
from ..protocol import (
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    HelloReply,
    Reply,
    Request,
    decode_reply_body,
)
from ..protocol import read_reply_header as read_header_frame
from ..transport import curve_client_options, resolve_client_credentials

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_TIMEOUT",
    "GOODBYE_TIMEOUT",
    "MONITOR_EVENTS",
    "HandshakeWatch",
    "curve_options",
    "dealer_options",
    "heartbeat_interval",
    "hello_request",
    "ping_due",
    "read_reply_header",
    "reply_or_error",
]

DEFAULT_TIMEOUT = 10.0
"""Seconds a request waits for its reply unless told otherwise."""
GOODBYE_TIMEOUT = 0.5
"""Seconds a closing client waits for the server to acknowledge its ``goodbye``."""
DEFAULT_HEARTBEAT_INTERVAL = 2.0
"""Seconds between heartbeats until the server's ``hello`` says how long it waits (then a
quarter of its heartbeat timeout)."""

MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
"""Connection events the clients follow: connected (handshake done) / gone / retrying /
refused at the handshake (CURVE)."""


_REFUSED_KEY = (
    "the server refused this client's CURVE key (it is not among the server's allowed keys; "
    "see docs/security.md)"
)
_SERVER_PLAIN = (
    "the server speaks plain ZeroMQ (no CURVE: it was started with --insecure) and this client "
    "speaks CURVE: connect it with --insecure (KVTRIO_INSECURE=1, insecure=True; "
    "docs/security.md)"
)
_SERVER_CURVE = (
    "the server speaks CURVE and this client plain ZeroMQ (it was told --insecure, "
    "KVTRIO_INSECURE or server_key none): give it the server's key and a client key, or run "
    "it as the server's user without those settings (docs/security.md)"
)
_CLOSED_ONCE = (
    "the server closed the connection during the CURVE handshake (it stopped meanwhile, it "
    "speaks plain ZeroMQ: started with --insecure, or it does not hold the secret of the "
    "server key this client uses)"
)
_CLOSED_AGAIN = (
    "the server closed the connection during every CURVE handshake: it does not hold the "
    "secret of the server key this client uses (a wrong server key: server_key, "
    "KVTRIO_SERVER_KEY, or the default keys of another server), or it speaks plain ZeroMQ "
    "(started with --insecure: connect with --insecure); docs/security.md"
)
_CLOSED_PLAIN = "the server closed the connection during the handshake (it stopped meanwhile?)"
_CLOSED_PLAIN_AGAIN = (
    "the server closed the connection during every handshake: most likely the server speaks "
    "CURVE and this client plain ZeroMQ (it was told --insecure, KVTRIO_INSECURE or "
    "server_key none: give it the server's key and a client key; docs/security.md), or it is "
    "not a kvtrio server of this version"
)
_GONE = (
    "the server closed the connection during the handshake and no longer listens: it stopped "
    "or was killed (not a key problem)"
)


class HandshakeWatch:
    """What a client's connection events say about its handshakes, for the user.

    A wrong server key and a server killed during the handshake look the same to a CURVE
    client at first (the server closes the connection); they differ in what follows: the
    next connection to a live server fails again the same way, while a killed server refuses
    the next connection (``EVENT_CLOSED``). A CURVE client of a plain server and the
    reverse are told apart by the mechanism mismatch ZeroMQ reports, and say which side
    speaks what.
    """

    def __init__(self, curve: bool) -> None:
        self.curve = curve
        self.error: str | None = None
        """Why the handshake fails, or None (none failed since the last that succeeded)."""
        self._closed = 0
        """Connections closed by the server during the handshake, in a row."""
        self._counted = False
        """Whether this connection's close is counted (one connection may report two)."""

    @property
    def undecided(self) -> bool:
        """True after a single handshake the server closed: whether the server is gone, does
        not take this client's server key or speaks plain ZeroMQ, the next event says (within
        a reconnection, ~0.1 s); fail-fast requests wait for it."""
        return self.error in (_CLOSED_ONCE, _CLOSED_PLAIN)

    def observe(self, event: int, value: int) -> str | None:
        """Follow one monitor event; returns the new :attr:`error` when it changed to a
        failure worth logging (once; not while :attr:`undecided`), else None."""
        if event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
            self._counted = False  # (the next failure is another connection's)
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.error, self._closed = None, 0
            return None
        error = self.error
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            error = _REFUSED_KEY
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                error = _SERVER_PLAIN if self.curve else _SERVER_CURVE
                self._closed = 0  # (the close that came with it was this mismatch)
            else:
                error = (
                    f"the handshake with the server failed (ZeroMQ protocol error {value:#x}: "
                    "a wrong server key, or not a kvtrio server; see docs/security.md)"
                )
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._closed += 0 if self._counted else 1
            self._counted = True
            if self._closed > 1:
                error = _CLOSED_AGAIN if self.curve else _CLOSED_PLAIN_AGAIN
            else:
                error = _CLOSED_ONCE if self.curve else _CLOSED_PLAIN
        elif event == zmq.EVENT_CLOSED and self._closed:
            error, self._closed = _GONE, 0  # the next connection was refused: nobody listens
        if error == self.error:
            return None
        self.error = error
        return None if self.undecided else error


def dealer_options() -> dict[int, Any]:
    """Options of a client's DEALER socket.

    ``IMMEDIATE`` stays off: with it on, libzmq discards replies that arrived but were not read
    yet when a connection drops, so the last replies of a stopping server could vanish. Instead
    the clients only write to the socket while the monitor says the connection is up, which
    keeps "not sent" meaning "not processed". The client picks its own routing id so that a
    reconnection to the same server finds its session again (the server sets ROUTER_HANDOVER).
    """
    return {
        zmq.ROUTING_ID: b"k" + os.urandom(15),
        zmq.RECONNECT_IVL: 100,
        zmq.RECONNECT_IVL_MAX: 1000,
        zmq.SNDHWM: 100_000,
        zmq.RCVHWM: 100_000,
    }


def curve_options(
    endpoint: str,
    server_key: str | None = None,
    client_key: str | None = None,
    insecure: bool | None = None,
) -> dict[int, Any]:
    """CURVE options for a client of ``endpoint`` (see ``docs/security.md``).

    For ``tcp://``: none with ``insecure`` (or ``KVTRIO_INSECURE``, or ``server_key="none"``):
    a plain connection, to a server started with ``--insecure``; else ``server_key`` (Z85 or
    key file) and ``client_key`` (``.key_secret`` file), else ``KVTRIO_SERVER_KEY`` /
    ``KVTRIO_CLIENT_KEY``, else the default keys of this user (the ones a server started by
    this user created). ``ipc://`` is protected by file permissions and takes no keys.
    :class:`ConfigError` for bad or missing key files (a client never creates keys).
    """
    if not endpoint.startswith("tcp://"):
        return {}
    credentials = resolve_client_credentials(server_key, client_key, insecure=insecure)
    return curve_client_options(credentials)


def hello_request(client_name: str) -> Hello:
    """What every client says on every connection (its name, version and protocol)."""
    return Hello(
        client_name=client_name, client_version=__version__, protocol_version=PROTOCOL_VERSION
    )


def heartbeat_interval(info: HelloReply | None) -> float:
    """Seconds between heartbeats: a quarter of the server's heartbeat timeout, from its
    ``hello`` (:data:`DEFAULT_HEARTBEAT_INTERVAL` before one)."""
    return info.heartbeat_timeout / 4 if info is not None else DEFAULT_HEARTBEAT_INTERVAL


def ping_due(now: float, last_send: float, info: HelloReply | None) -> bool:
    """Whether a connected client that last sent at ``last_send`` pings at ``now``: nothing was
    sent for a heartbeat interval (any request counts as a sign of life)."""
    return now - last_send >= heartbeat_interval(info)


def read_reply_header(frames: list[bytes]) -> tuple[int, str] | None:
    """``(call_id, kind)`` of a reply, or None for a message that is not a well-formed
    reply."""
    if len(frames) != 2:
        return None
    try:
        return read_header_frame(frames[0])
    except ProtocolError:
        return None


def reply_or_error(kind: str, body: bytes, request_type: type[Request]) -> Reply | ServerError:
    """Decode the body of a ``kind`` reply; an error reply becomes the :class:`ServerError` to
    raise."""
    reply = decode_reply_body(kind, body, request_type)
    if type(reply) is ErrorReply:
        return ServerError.from_reply(reply.code, reply.message)
    return reply
