"""A raw ROUTER the test answers by hand: it decides which request gets which reply, and when."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import zmq

from kvtrio.client import Client
from kvtrio.errors import ErrorCode
from kvtrio.protocol import (
    PROTOCOL_VERSION,
    HelloReply,
    Reply,
    Request,
    decode_request,
    encode_error,
    encode_reply,
)

from .._support.waiting import wait_for


class Taken:
    """One request the raw server received."""

    def __init__(self, identity: bytes, call_id: int, op: str, body: bytes) -> None:
        self.identity = identity
        self.call_id = call_id
        self.op = op
        self.body = body

    @property
    def request(self) -> Request:
        return decode_request(self.op, self.body)


class RawServer:
    def __init__(self, endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)

    def take(self) -> Taken:
        """The next request (waits up to 10 s for it)."""
        assert self.sock.poll(10_000), "no request came"
        identity, header, body = self.sock.recv_multipart()
        _, call_id, op = msgpack.unpackb(header)
        return Taken(identity, call_id, op, body)

    def answer(self, taken: Taken, reply: Reply) -> None:
        self.sock.send_multipart([taken.identity, *encode_reply(taken.call_id, taken.op, reply)])

    def refuse(self, taken: Taken, code: ErrorCode, message: str) -> None:
        self.sock.send_multipart([taken.identity, *encode_error(taken.call_id, code, message)])

    def close(self) -> None:
        self.sock.close(linger=0)


@contextmanager
def client_of_raw_server(endpoint: str) -> Iterator[tuple[Client, RawServer]]:
    """A :class:`Client` connected to a :class:`RawServer`, its hello answered."""
    server = RawServer(endpoint)
    try:
        with Client(endpoint, heartbeat=False) as client:
            hello = server.take()
            assert hello.op == "hello"
            server.answer(hello, HelloReply("raw", PROTOCOL_VERSION, "raw", 256, 60.0, 1 << 20))
            wait_for(lambda: client.server_info is not None, what="hello")
            yield client, server
    finally:
        server.close()
