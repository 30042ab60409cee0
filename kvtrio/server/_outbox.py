"""Replies to clients: the one place the request path sends on the ROUTER socket.

The router and the sessions both answer through an :class:`Outbox`, so neither imports the
other: the router owns the receiving side, the outbox the sending side.
"""

from __future__ import annotations

import trio

from ..errors import ErrorCode, PeerUnreachable
from ..protocol import encode_error
from ..transport import Socket
from ._state import ServerState

__all__ = ["Outbox"]

_MAX_BACKOFF = 0.05


class Outbox:
    """Sends replies on the server's ROUTER socket, never blocking another client."""

    def __init__(self, state: ServerState, socket: Socket) -> None:
        self._state = state
        self._socket = socket

    def try_send(self, identity: bytes, frames: list[bytes]) -> bool:
        """Send a reply now if ``identity``'s client can take it; False if its queue is full.

        A client that is gone is counted as an undeliverable reply (and True is returned:
        there is nothing left to do for it).
        """
        try:
            return self._socket.try_send_multipart([identity, *frames])
        except PeerUnreachable:
            self._state.counters.replies_undeliverable += 1
            return True

    def answer_now(
        self, identity: bytes, call_id: int, code: ErrorCode, message: str, kind: str = "?"
    ) -> None:
        """Send an error reply to a ``kind`` request without waiting; if the client cannot take
        it now, count it."""
        state = self._state
        state.counters.error(code)
        if state.observe_request is not None:
            state.observe_request(kind, code, 0.0)
        self.send_or_count(identity, encode_error(call_id, code, message))

    def send_or_count(self, identity: bytes, frames: list[bytes]) -> None:
        """Send without waiting; a reply the client cannot take now is counted as lost."""
        if not self.try_send(identity, frames):
            self._state.counters.replies_undeliverable += 1

    async def reply(self, identity: bytes, frames: list[bytes]) -> None:
        """Send a reply to ``identity``'s client.

        If the client's receive queue is full, retry with backoff for up to the heartbeat
        timeout; a reply to a client that disconnected, or that never drains its queue, is
        dropped and counted. Does not checkpoint when the reply goes out at once.
        Cancellation (the session or the server ends meanwhile): one last try without
        waiting, and the reply is counted if it cannot go (was: neither sent nor counted).
        """
        if self.try_send(identity, frames):
            return
        delay = 0.0005
        try:
            with trio.move_on_after(self._state.config.heartbeat_timeout):
                while True:
                    await trio.sleep(delay)
                    if self.try_send(identity, frames):
                        return
                    delay = min(delay * 2, _MAX_BACKOFF)
        except trio.Cancelled:
            self.send_or_count(identity, frames)
            raise
        self._state.counters.replies_undeliverable += 1
