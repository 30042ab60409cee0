"""Heartbeat deadlines count the event loop's progress, not the time it was stalled (issue 22)."""

from __future__ import annotations

import time

import pytest
import trio
import zmq

from kvtrio.protocol import ChunkSize, GetChunkSize, Ping, decode_reply_header, encode_request
from kvtrio.server import ServerHandle, Session
from kvtrio.transport import open_socket

_STALL = 1.0
"""Seconds the test holds the loop: three heartbeat timeouts."""


@pytest.mark.parametrize("server_config", [{"heartbeat_timeout": 0.3}], indirect=True)
async def test_a_stalled_loop_does_not_end_the_sessions_it_kept_waiting(
    server: ServerHandle,
) -> None:
    """Was: when the loop came back from a stall longer than the heartbeat timeout, every
    session whose deadline fell inside it expired before the router could read the messages
    waiting for it (a hostile batch at world 4096 ended another tenant's worker session)."""

    def stall(session: Session, request: GetChunkSize) -> ChunkSize:
        time.sleep(_STALL)  # a message that holds the event loop (here: on purpose)
        return ChunkSize(1)

    server.state.register_inline(GetChunkSize, stall)
    async with open_socket(zmq.DEALER) as victim, open_socket(zmq.DEALER) as hostile:
        victim.connect(server.endpoint)
        hostile.connect(server.endpoint)
        with trio.fail_after(10):
            await victim.send_multipart(encode_request(1, Ping()))
            await victim.recv_multipart()
            await hostile.send_multipart(encode_request(1, GetChunkSize()))
            await hostile.recv_multipart()  # after the stall
            await victim.send_multipart(encode_request(2, Ping()))
            header, _ = await victim.recv_multipart()
    assert decode_reply_header(header).kind == "ping"
    counters = server.state.counters
    assert counters.sessions_expired == 0
    assert counters.sessions_started == 2  # the victim's second ping in its first session
    assert server.state.heartbeats.longest_stall >= _STALL * 0.9


class _Watched:
    def __init__(self, deadline: float) -> None:
        self.heartbeat_deadline = deadline
        self.ending = False
        self.expired = 0

    def expire(self) -> None:
        self.expired += 1
        self.ending = True


def test_a_session_expires_once_at_its_latest_deadline() -> None:
    from kvtrio.server._heartbeats import Heartbeats

    heartbeats = Heartbeats(heartbeat_timeout=10.0)
    session = _Watched(5.0)
    heartbeats.watch(session)
    session.heartbeat_deadline = 7.0  # heard from: a later deadline
    heartbeats.watch(session)
    assert heartbeats.expire(6.0) == 0  # (the first deadline is stale)
    assert heartbeats.expire(7.0) == 1
    assert heartbeats.expire(100.0) == 0
    assert session.expired == 1
    assert heartbeats.progress(12.0) == 12.0
    heartbeats.stalled = 2.0
    assert heartbeats.progress(12.0) == 10.0
