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
    "curve_options",
    "dealer_options",
    "handshake_failure",
    "hello_request",
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


def handshake_failure(event: int) -> str | None:
    """What a failed handshake event means for the user, or None for other events."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            "the server refused this client's CURVE key (it is not among the server's allowed "
            "keys; see docs/security.md)"
        )
    if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
        return (
            "the handshake with the server failed (a wrong server key, or CURVE on one side "
            "only, e.g. a plain client of a CURVE server; see docs/security.md)"
        )
    return None


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
    endpoint: str, server_key: str | None = None, client_key: str | None = None
) -> dict[int, Any]:
    """CURVE options for a client of ``endpoint`` (see ``docs/security.md``).

    For ``tcp://``: ``server_key`` (Z85 or key file) and ``client_key`` (``.key_secret`` file),
    else ``KVTRIO_SERVER_KEY`` / ``KVTRIO_CLIENT_KEY``, else the default keys of this user (the
    ones a server started by this user created); none of these: a plain connection. ``ipc://``
    is protected by file permissions and takes no keys. :class:`ConfigError` for bad key files.
    """
    if not endpoint.startswith("tcp://"):
        return {}
    return curve_client_options(resolve_client_credentials(server_key, client_key))


def hello_request(client_name: str) -> Hello:
    return Hello(
        client_name=client_name, client_version=__version__, protocol_version=PROTOCOL_VERSION
    )


def read_reply_header(frames: list[bytes]) -> tuple[int, str] | None:
    """``(request_id, kind)`` of a reply, or None for a message that is not a well-formed
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
