"""kvtrio's exception tree, shared by every layer.

Every error that crosses a public boundary is a :class:`KvtrioError`. Errors raised by the libraries
underneath (pyzmq, msgpack, cattrs, the OS) are mapped into this tree where they cross into kvtrio,
so that callers never need to catch a third-party exception type.

Errors that travel over the wire carry a stable :class:`ErrorCode`: the server answers a failed
request with ``(code, message)`` and the client raises the :class:`ServerError` subclass registered
for that code.
"""

from __future__ import annotations

import enum
from typing import ClassVar

__all__ = [
    "BadRequest",
    "ClientClosed",
    "ClientError",
    "ConfigError",
    "ConnectionLost",
    "ErrorCode",
    "Forbidden",
    "Incompatible",
    "InternalServerError",
    "KvtrioError",
    "MessageTooLarge",
    "NotRegistered",
    "PeerUnreachable",
    "ProtocolError",
    "QuotaExceeded",
    "RequestError",
    "RequestTimeout",
    "ServerBusy",
    "ServerError",
    "ServerUnavailable",
    "SessionEnded",
    "ShuttingDown",
    "TransportError",
    "UnknownOperation",
    "UnsupportedVersion",
]


class ErrorCode(str, enum.Enum):
    """Stable error codes of the wire protocol (documented in ``docs/protocol.md``).

    New codes may be added; existing codes never change meaning. A client that meets a code it
    does not know treats it like ``internal``.
    """

    BAD_REQUEST = "bad_request"
    """The request frames or body are malformed: wrong types, missing fields, bad values."""
    UNKNOWN_OPERATION = "unknown_operation"
    """The header names an operation this server does not implement."""
    UNSUPPORTED_VERSION = "unsupported_version"
    """The header's protocol version is not one this server speaks."""
    MESSAGE_TOO_LARGE = "message_too_large"
    """The request is larger than the server's ``max_message_size``."""
    BUSY = "busy"
    """The client has too many requests queued at the server; retry later."""
    SHUTTING_DOWN = "shutting_down"
    """The server is draining or stopping; the request was not (or not fully) handled."""
    SESSION_ENDED = "session_ended"
    """The client's session ended (heartbeat timeout) before the request was answered; what the
    session held is gone. The request may be retried: it starts a new session."""
    NOT_REGISTERED = "not_registered"
    """A worker operation came from a client that has not registered its KV cache (or whose
    session ended, e.g. after a server restart): register again."""
    INCOMPATIBLE = "incompatible"
    """The registration or lookup conflicts with how the model is already registered (KV
    format, hash scheme, world size); the message says what differs."""
    FORBIDDEN = "forbidden"
    """The client's credentials do not allow the request (e.g. it names a tenant its key may
    not use, or a connection without authentication names a tenant)."""
    QUOTA_EXCEEDED = "quota_exceeded"
    """The request would take the client (or its tenant) beyond a limit of the server: pins,
    reservations, loads in flight, readers. Release what it holds, or retry later."""
    INTERNAL = "internal"
    """The server failed while handling a valid request (a bug; the server logged it)."""

    def __str__(self) -> str:
        return self.value


class KvtrioError(Exception):
    """Base class of every error kvtrio raises on purpose."""


class ConfigError(KvtrioError):
    """A setting is invalid. The message names the setting and what is wrong, in one line."""


class TransportError(KvtrioError):
    """The transport (a ZeroMQ socket) failed."""


class PeerUnreachable(TransportError):
    """A ROUTER socket cannot route a message: the peer disconnected."""


class RequestError(KvtrioError):
    """A request cannot be served; becomes an error reply with :attr:`code` and the message.

    Raised by the protocol layer when decoding fails and by server handlers for expected failures.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.value!r}, {self.message!r})"


class ProtocolError(RequestError):
    """Bytes received from a peer do not form a valid message."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(code, message)


# --------------------------------------------------------------------------- client side


class ClientError(KvtrioError):
    """A request could not be completed for a reason on the client's side of the wire."""


class RequestTimeout(ClientError, TimeoutError):
    """No reply arrived within the request's timeout."""


class ConnectionLost(ClientError):
    """The connection to the server dropped while the request was in flight.

    The server may or may not have processed the request.
    """


class ServerUnavailable(ClientError):
    """The request could not be sent: no connection to the server. It was not processed."""


class ClientClosed(ClientError):
    """The client was closed before the request completed."""


class ServerError(KvtrioError):
    """The server answered the request with an error reply.

    ``ServerError.from_reply(code, message)`` returns the subclass registered for ``code``
    (a plain :class:`ServerError` for codes this client does not know).
    """

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL
    _by_code: ClassVar[dict[str, type[ServerError]]] = {}

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.wire_code = code if code is not None else self.code.value

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        ServerError._by_code[cls.code.value] = cls

    def __str__(self) -> str:
        return f"[{self.wire_code}] {self.message}"

    @staticmethod
    def from_reply(code: str, message: str) -> ServerError:
        """Build the exception a client raises for an error reply ``(code, message)``."""
        cls = ServerError._by_code.get(code, ServerError)
        return cls(message, code)


class BadRequest(ServerError):
    code = ErrorCode.BAD_REQUEST


class UnknownOperation(ServerError):
    code = ErrorCode.UNKNOWN_OPERATION


class UnsupportedVersion(ServerError):
    code = ErrorCode.UNSUPPORTED_VERSION


class MessageTooLarge(ServerError):
    code = ErrorCode.MESSAGE_TOO_LARGE


class ServerBusy(ServerError):
    code = ErrorCode.BUSY


class ShuttingDown(ServerError):
    code = ErrorCode.SHUTTING_DOWN


class SessionEnded(ServerError):
    code = ErrorCode.SESSION_ENDED


class NotRegistered(ServerError):
    code = ErrorCode.NOT_REGISTERED


class Incompatible(ServerError):
    code = ErrorCode.INCOMPATIBLE


class Forbidden(ServerError):
    code = ErrorCode.FORBIDDEN


class QuotaExceeded(ServerError):
    code = ErrorCode.QUOTA_EXCEEDED


class InternalServerError(ServerError):
    code = ErrorCode.INTERNAL
