"""The hot path: SET and GET of large values straight between the caller's buffers and a socket.

redis-py builds every reply in Python: its parser reads 64 KiB pieces into a ``BytesIO`` and
copies the value out twice, and a SET needs the value as one ``bytes`` — a join of header and
chunk. For values of megabytes these copies, not the network, set the pace (on the development
VM, GET of 32 MiB values: 0.3 GB/s through ``Redis.get``, 0.7 GB/s with ``recv_into`` straight
into the destination; SET: 0.46 GB/s with a join, 1.0 GB/s without). So for these two
commands, and only them, the backend speaks RESP itself on a connection taken from redis-py's
pool: redis-py still connects, authenticates, selects the database, does TLS and health checks,
and returns the connection to its pool afterwards.

A request is sent as one pipelined batch (every command, then every reply), so a call with many
keys costs one round trip. Error replies are returned per command as the exception redis-py
would raise for them, so the stream stays in step and the caller decides (a ``MOVED`` is
followed, an ``OOM`` is a refused store). Anything that leaves the stream out of step raises
redis-py's ``ConnectionError``/``TimeoutError`` and the caller must disconnect the connection.

Everything here is blocking and runs in worker threads; there is no cancellation inside.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from redis import exceptions

__all__ = ["ReplyReader", "byte_views", "connection_socket", "pack_get", "pack_set", "send"]

_SMALL = 16 << 10  # pieces below this are coalesced before sending
_SKIP = 1 << 20  # scratch size when a value of the wrong length is read and dropped

# error-reply prefix → the exception redis-py raises for it
_ERRORS: dict[str, type[exceptions.RedisError]] = {
    "MOVED": exceptions.MovedError,
    "ASK": exceptions.AskError,
    "TRYAGAIN": exceptions.TryAgainError,
    "CLUSTERDOWN": exceptions.ClusterDownError,
    "OOM": exceptions.OutOfMemoryError,
    "LOADING": exceptions.BusyLoadingError,
    "READONLY": exceptions.ReadOnlyError,
}


def byte_views(parts: Sequence[memoryview]) -> list[memoryview]:
    """The parts as flat unsigned-byte views (``len`` is then their size in bytes)."""
    return [memoryview(part).cast("B") for part in parts]


def pack_set(name: bytes, views: Sequence[memoryview], ttl_ms: int) -> list[bytes | memoryview]:
    """``SET name <the views, concatenated> [PX ttl_ms]`` as pieces to send (no copy)."""
    size = sum(len(view) for view in views)
    argc = 5 if ttl_ms else 3
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (argc, len(name), name, size)
    tail = b"\r\n"
    if ttl_ms:
        text = b"%d" % ttl_ms
        tail += b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(text), text)
    return [head, *(view for view in views if len(view)), tail]


def pack_get(name: bytes) -> bytes:
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name)


def connection_socket(connection: Any) -> socket.socket | None:
    """The connected socket of a redis-py connection, None if it has none we can use."""
    sock = getattr(connection, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def send(sock: socket.socket, pieces: Sequence[bytes | memoryview]) -> None:
    """Send the pieces in order: small neighbours joined into one write, large ones as they are
    (never copied)."""
    batch: list[bytes | memoryview] = []
    batch_size = 0
    try:
        for piece in pieces:
            if len(piece) >= _SMALL:
                if batch:
                    sock.sendall(b"".join(batch))
                    batch, batch_size = [], 0
                sock.sendall(piece)
                continue
            batch.append(piece)
            batch_size += len(piece)
            if batch_size >= _SMALL:
                sock.sendall(b"".join(batch))
                batch, batch_size = [], 0
        if batch:
            sock.sendall(b"".join(batch))
    except TimeoutError:  # socket.timeout
        raise exceptions.TimeoutError("Timeout writing to socket") from None
    except (OSError, ValueError) as exc:  # ValueError: the socket was closed meanwhile
        raise exceptions.ConnectionError(f"Error while writing to socket: {exc}") from None


class ReplyReader:
    """Reads RESP replies from a socket; bulk values go straight into the caller's buffers."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pending = bytearray()  # received, not consumed yet

    def read_status(self) -> exceptions.RedisError | None:
        """Consume a simple-string reply (``+OK``); an error reply is returned, not raised."""
        line = self._line()
        if line[:1] == b"+":
            return None
        if line[:1] == b"-":
            return _error(line)
        raise exceptions.InvalidResponse(f"unexpected reply to SET: {line[:60]!r}")

    def read_bulk_into(self, views: Sequence[memoryview]) -> int | exceptions.RedisError:
        """Consume a bulk-string reply: into ``views`` if it is exactly as long as they are,
        otherwise it is skipped. Returns its length (-1 for nil) or the error reply."""
        line = self._line()
        kind = line[:1]
        if kind == b"$":
            length = int(line[1:])
            if length < 0:
                return -1
            if length == sum(len(view) for view in views):
                for view in views:
                    self._read_into(view)
            else:
                self._skip(length)
            if self._take(2) != b"\r\n":
                raise exceptions.InvalidResponse("bulk string without its CRLF")
            return length
        if kind == b"_":  # RESP3 null
            return -1
        if kind == b"-":
            return _error(line)
        raise exceptions.InvalidResponse(f"unexpected reply to GET: {line[:60]!r}")

    # ----------------------------------------------------------------- internals

    def _recv(self, size: int) -> bytes:
        try:
            data = self._sock.recv(size)
        except TimeoutError:
            raise exceptions.TimeoutError("Timeout reading from socket") from None
        except (OSError, ValueError) as exc:
            raise exceptions.ConnectionError(f"Error while reading from socket: {exc}") from None
        if not data:
            raise exceptions.ConnectionError("Connection closed by server.")
        return data

    def _line(self) -> bytes:
        start = 0
        while (end := self._pending.find(b"\r\n", start)) < 0:
            start = max(0, len(self._pending) - 1)
            self._pending += self._recv(65536)
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def _read_into(self, view: memoryview) -> None:
        if self._pending:
            count = min(len(view), len(self._pending))
            view[:count] = self._pending[:count]
            del self._pending[:count]
            view = view[count:]
        try:
            while view:
                count = self._sock.recv_into(view)
                if not count:
                    raise exceptions.ConnectionError("Connection closed by server.")
                view = view[count:]
        except TimeoutError:
            raise exceptions.TimeoutError("Timeout reading from socket") from None
        except (OSError, ValueError) as exc:
            raise exceptions.ConnectionError(f"Error while reading from socket: {exc}") from None

    def _skip(self, length: int) -> None:
        scratch = memoryview(bytearray(min(length, _SKIP)))
        while length:
            count = min(length, len(scratch))
            self._read_into(scratch[:count])
            length -= count

    def _take(self, size: int) -> bytes:
        while len(self._pending) < size:
            self._pending += self._recv(65536)
        data = bytes(self._pending[:size])
        del self._pending[:size]
        return data


def _error(line: bytes) -> exceptions.RedisError:
    """The exception redis-py's parser makes of an error reply (known codes are stripped)."""
    text = line[1:].decode(errors="replace")
    code, _, rest = text.partition(" ")
    cls = _ERRORS.get(code)
    return exceptions.ResponseError(text) if cls is None else cls(rest or text)
