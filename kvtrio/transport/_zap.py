"""A ZAP handler (ZeroMQ's authentication protocol, RFC 27) as a trio task.

libzmq asks the handler bound at ``inproc://zeromq.zap.01`` *of the socket's context* about
every CURVE handshake; the handler answers 200 with a user id, or 400. We run it as a task of
the server's own tree (not ``zmq.auth.ThreadAuthenticator``'s thread, not its asyncio variant):
its decision reads the server's key table in the server's own thread, and it stops with the
server. The server uses a context of its own, so that two servers in one process (tests) each
have their handler, and clients' sockets (``zmq.Context.instance()``) are never affected.

Must be listening before the CURVE socket binds: libzmq accepts every handshake when no handler
is bound.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
import zmq
from zmq.utils import z85

from ._zmq import open_socket

__all__ = ["ZAP_ENDPOINT", "serve_zap"]

log = logging.getLogger("kvtrio.transport")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"

Authorize = Callable[[bytes, bytes], "str | None"]
"""``authorize(client public key (Z85), ZAP domain) -> user id``, or None to refuse the
handshake. The domain is the server socket's ``ZAP_DOMAIN`` (the KV events sockets have their
own, so a key can be refused there alone)."""


def zap_reply(frames: list[bytes], authorize: Authorize) -> list[bytes]:
    """The reply to one ZAP request (no I/O)."""
    if len(frames) < 6 or frames[0] != b"1.0":
        request_id = frames[1] if len(frames) > 1 else b""
        return [b"1.0", request_id, b"500", b"malformed ZAP request", b"", b""]
    request_id, domain, mechanism = frames[1], frames[2], frames[5]
    if mechanism != b"CURVE" or len(frames) != 7 or len(frames[6]) != 32:
        return [b"1.0", request_id, b"400", b"CURVE only", b"", b""]
    public = z85.encode(frames[6])
    user = authorize(public, domain)
    if user is None:
        return [b"1.0", request_id, b"400", b"unknown key", b"", b""]
    return [b"1.0", request_id, b"200", b"OK", user.encode(), b""]


async def serve_zap(
    context: zmq.Context[Any],
    authorize: Authorize,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer ``context``'s ZAP requests with ``authorize`` until cancelled.

    ``task_status.started()`` once bound. Cancellation: the socket closes; a handshake waiting
    for an answer then fails (the client retries against the next server).
    """
    async with open_socket(zmq.REP, context=context) as socket:
        socket.bind(ZAP_ENDPOINT)
        task_status.started()
        while True:
            frames = await socket.recv_multipart()
            reply = zap_reply(frames, authorize)
            if reply[2] != b"200":
                log.info("refused a CURVE handshake: %s", reply[3].decode())
            await socket.send_multipart(reply)
