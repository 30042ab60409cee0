"""The seam between the router and the sessions: what the router hands a session
(:class:`Incoming`) and what a session answers its client through (:class:`Replies`, the
router's ``Outbox``). The session module knows neither the router nor the socket.
"""

from __future__ import annotations

from typing import Protocol

from ..errors import ErrorCode, RequestError
from ._state import Later

__all__ = ["Incoming", "Replies"]


class Replies(Protocol):
    """How a session answers its client: the sending side of the server's socket (the
    router's ``Outbox``; the session knows neither the router nor the socket)."""

    def try_send(self, identity: bytes, frames: list[bytes]) -> bool:
        """Send now if the client can take it; False if its queue is full."""
        ...

    def send_or_count(self, identity: bytes, frames: list[bytes]) -> None:
        """Send without waiting; count the reply as lost if the client cannot take it."""
        ...

    def answer_now(
        self, identity: bytes, call_id: int, code: ErrorCode, message: str, kind: str = "?"
    ) -> None:
        """Send an error reply without waiting (counted, observed)."""
        ...

    async def reply(self, identity: bytes, frames: list[bytes]) -> None:
        """Send, retrying with backoff while the client's queue is full."""
        ...


class Incoming:
    """A request as the router hands it to a session: header already read, body not decoded.

    ``error`` is set when the router already knows the request must fail (bad framing, too
    large); the session then answers it with that error, in order. A plain class with slots:
    one is made per message.
    """

    __slots__ = ("body", "call_id", "error", "frames", "kind", "later", "received")

    def __init__(
        self,
        call_id: int,
        kind: str,
        body: bytes,
        error: RequestError | None = None,
        received: float = 0.0,
    ) -> None:
        self.call_id = call_id
        self.kind = kind
        self.body = body
        self.error = error
        self.received = received
        """``trio.current_time()`` when the router read it (request latency starts here)."""
        self.frames: list[bytes] | None = None
        """Set when it was answered inline but the client could not take the reply then."""
        self.later: Later | None = None
        """Set when an inline handler left the rest to the session's task."""
