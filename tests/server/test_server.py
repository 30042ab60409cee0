"""The server in the test's trio loop: operations, bad input, sessions, heartbeats, drain."""

from __future__ import annotations

import collections
import logging
from collections.abc import AsyncIterator

import msgpack
import pytest
import trio
import trio.lowlevel
import trio.testing
import zmq

from kvtrio.client import AsyncClient, open_client
from kvtrio.config import ServerConfig
from kvtrio.errors import InternalServerError, ShuttingDown, UnsupportedVersion
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    PROTOCOL_VERSION,
    ChunkSize,
    GetChunkSize,
    GetStats,
    Goodbye,
    Hello,
    HelloReply,
    LayoutSpec,
    Ping,
    Pong,
    Probe,
    ProbeReply,
    Register,
    StatsReply,
    decode_reply_header,
    encode_request,
)
from kvtrio.server import ServerHandle, Session, serve
from kvtrio.server._state import Later
from kvtrio.transport import Socket, open_socket

from .._support.waiting import await_condition


@pytest.fixture
async def client(server: ServerHandle) -> AsyncIterator[AsyncClient]:
    async with open_client(server.endpoint, timeout=5) as client:
        yield client


@pytest.fixture
async def raw(server: ServerHandle) -> AsyncIterator[Socket]:
    """A bare DEALER socket for sending arbitrary frames."""
    async with open_socket(zmq.DEALER) as dealer:
        dealer.connect(server.endpoint)
        yield dealer


async def stats(client: AsyncClient) -> StatsReply:
    return await client.call(GetStats(), StatsReply)


async def test_ping_hello_chunk_size_stats(server: ServerHandle, client: AsyncClient) -> None:
    pong = await client.call(Ping(), Pong)
    assert pong.instance_id == server.instance_id
    info = await client.call(Hello("tester", "9", PROTOCOL_VERSION), HelloReply)
    assert (info.chunk_size, info.protocol_version) == (256, PROTOCOL_VERSION)
    assert (await client.call(GetChunkSize(), ChunkSize)).chunk_size == 256
    probe = await client.call(Probe(tuple(range(256)), tuple(range(64))), ProbeReply)
    assert (probe.tokens, probe.block_ids) == (256, 64)
    reply = await stats(client)
    (session,) = reply.sessions
    assert session.client_name == "tester"
    assert session.requests >= 5
    assert reply.counters.errors == 0


async def test_hello_with_another_protocol_version_is_refused(client: AsyncClient) -> None:
    with pytest.raises(UnsupportedVersion, match="speaks protocol version 7"):
        await client.request(Hello("old-engine", "0.0", 7))


async def exchange(raw: Socket, messages: list[list[bytes]]) -> dict[int, list[tuple[str, dict]]]:
    """Send ``messages`` then a ping; collect replies by call id until the ping's arrives."""
    for frames in messages:
        await raw.send_multipart(frames)
    await raw.send_multipart(encode_request(999_999, Ping()))
    replies: dict[int, list[tuple[str, dict]]] = {}
    with trio.fail_after(10):
        while True:
            header_frame, body = await raw.recv_multipart()
            header = decode_reply_header(header_frame)
            replies.setdefault(header.call_id, []).append((header.kind, msgpack.unpackb(body)))
            if header.call_id == 999_999:
                return replies


def header(call_id: int, op: str, version: int = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb([version, call_id, op])


BAD_INPUT = {
    1: ([header(1, "frobnicate"), msgpack.packb({})], "unknown_operation"),
    2: ([header(2, "hello"), msgpack.packb({"client_name": 3})], "bad_request"),
    3: ([header(3, "hello"), msgpack.packb({})], "bad_request"),
    4: ([header(4, "ping")], "bad_request"),
    5: ([header(5, "ping"), b"\x80", b"extra"], "bad_request"),
    6: ([header(6, "ping"), b"\x80" + b"\0" * (1100 << 10)], "message_too_large"),
    7: ([header(7, "ping", version=1), b"\x80"], "unsupported_version"),  # a protocol 1 client
    8: ([header(8, "ping"), b""], "bad_request"),
    9: ([header(9, "ping"), b"\xc1garbage"], "bad_request"),
    10: ([msgpack.packb([1, 10]), b"\x80"], "bad_request"),
    11: ([header(11, "stats"), msgpack.packb([1, 2, 3])], "bad_request"),
    12: (
        [header(12, "probe"), msgpack.packb({"tokens": [1, "2"], "block_ids": []})],
        "bad_request",
    ),
}
UNRECOVERABLE = [[b"\xc1\xc1"], [b""], [msgpack.packb("just a string"), b"\x80"], [b"x" * 5000]]


@pytest.mark.parametrize("server_config", [{"max_message_size": 1 << 20}], indirect=True)
async def test_every_bad_request_gets_exactly_one_error_reply(
    raw: Socket, client: AsyncClient
) -> None:
    messages = [frames for frames, _ in BAD_INPUT.values()] + UNRECOVERABLE
    replies = await exchange(raw, messages)
    for call_id, (_, code) in BAD_INPUT.items():
        assert len(replies[call_id]) == 1, call_id
        kind, body = replies[call_id][0]
        assert kind == "error"
        assert body["code"] == code, (call_id, body)
        assert body["message"]
    assert set(replies) == {*BAD_INPUT, 999_999}
    counters = (await stats(client)).counters
    assert counters.frames_dropped == len(UNRECOVERABLE)
    assert counters.errors == len(BAD_INPUT)
    expected_codes = collections.Counter(code for _, code in BAD_INPUT.values())
    assert counters.errors_by_code == dict(expected_codes)


async def test_handler_exception_is_an_internal_error_with_a_logged_traceback(
    server: ServerHandle, client: AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(session: Session, request: GetChunkSize) -> ChunkSize:
        raise ZeroDivisionError("oops")

    server.state.register(GetChunkSize, broken)
    with (
        caplog.at_level(logging.ERROR, logger="kvtrio.server"),
        pytest.raises(InternalServerError, match="failed while handling 'get_chunk_size'"),
    ):
        await client.request(GetChunkSize())
    assert "ZeroDivisionError: oops" in caplog.text
    assert isinstance(await client.request(Ping()), Pong)


class Gate:
    """A handler for GetChunkSize that waits until released (to make a session busy)."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.entered = 0

    async def __call__(self, session: Session, request: GetChunkSize) -> ChunkSize:
        self.entered += 1
        await self.release.wait()
        return ChunkSize(self.entered)


async def test_a_slow_client_does_not_stall_another(
    server: ServerHandle, client: AsyncClient
) -> None:
    gate = Gate()
    server.state.register(GetChunkSize, gate)
    results: list[object] = []
    async with open_client(server.endpoint) as slow, trio.open_nursery() as nursery:

        async def slow_requests() -> None:
            results.append(await slow.request(GetChunkSize()))
            results.append(await slow.request(Ping()))

        nursery.start_soon(slow_requests)
        await await_condition(lambda: gate.entered == 1, what="the slow request to start")
        with trio.fail_after(5):
            for _ in range(20):
                assert isinstance(await client.request(Ping()), Pong)
        assert results == []
        gate.release.set()
    assert results[0] == ChunkSize(1)
    assert isinstance(results[1], Pong)


async def _replies_in_order(raw: Socket, count: int) -> list[tuple[int, str]]:
    received = []
    with trio.fail_after(5):
        while len(received) < count:
            header_frame, _ = await raw.recv_multipart()
            h = decode_reply_header(header_frame)
            received.append((h.call_id, h.kind))
    return received


async def test_inline_requests_keep_their_place_behind_a_waiting_one(
    server: ServerHandle, raw: Socket
) -> None:
    gate = Gate()
    server.state.register(GetChunkSize, gate)  # waits: the session is busy while it does
    await raw.send_multipart(encode_request(1, GetChunkSize()))
    await await_condition(lambda: gate.entered == 1, what="the waiting request to start")
    await raw.send_multipart(encode_request(2, Ping()))  # inline, but queued behind 1
    await raw.send_multipart(encode_request(3, Probe(tokens=(1,), block_ids=())))
    await trio.testing.wait_all_tasks_blocked()
    gate.release.set()
    assert await _replies_in_order(raw, 3) == [(1, "get_chunk_size"), (2, "ping"), (3, "probe")]


async def test_a_goodbye_queued_behind_a_waiting_request_still_ends_the_session(
    server: ServerHandle, raw: Socket
) -> None:
    """A client that closes while a request of it waits: its goodbye is queued, not answered
    inline, and must end the session all the same (not leave it, and what it holds, to the
    heartbeat timeout)."""
    gate = Gate()
    server.state.register(GetChunkSize, gate)
    await raw.send_multipart(encode_request(1, GetChunkSize()))
    await await_condition(lambda: gate.entered == 1, what="the waiting request to start")
    await raw.send_multipart(encode_request(2, Goodbye()))
    await trio.testing.wait_all_tasks_blocked()
    gate.release.set()
    assert await _replies_in_order(raw, 2) == [(1, "get_chunk_size"), (2, "goodbye")]
    await await_condition(lambda: not server.state.sessions, what="the session to end")


async def test_a_client_going_on_after_its_goodbye_gets_a_session_of_its_own(
    server: ServerHandle, raw: Socket
) -> None:
    """Goodbye and a new register back to back on one connection: the second is a new
    session, whose registration the first one's cleanup must leave alone. Was: session ids
    came from the routing id alone, the new session was never watched (its id was), and the
    old cleanup dropped its registration just after answering it ok (10 of 16 tries)."""
    register = Register("w", "m", 1, 0, LayoutSpec("flash_attn", 2, 64, 16, 2, 16, "float16"),
                        HASH_SCHEME_TOKENS)  # fmt: skip
    await raw.send_multipart(encode_request(1, register))
    assert await _replies_in_order(raw, 1) == [(1, "register")]
    (old,) = [session.id for session in server.state.sessions.values()]
    counters = server.state.counters
    ended = counters.sessions_ended
    await raw.send_multipart(encode_request(2, Goodbye()))
    await raw.send_multipart(encode_request(3, register))
    assert await _replies_in_order(raw, 2) == [(2, "goodbye"), (3, "register")]
    await await_condition(
        lambda: counters.sessions_ended == ended + 1, what="the old session's cleanups to run"
    )
    (new,) = [session.id for session in server.state.sessions.values()]
    assert new != old
    assert list(server.state.cache.core.registry.by_session) == [new]  # type: ignore[union-attr]


async def test_the_waiting_part_of_an_inline_request_keeps_its_order(
    server: ServerHandle, raw: Socket
) -> None:
    gate = Gate()
    started: list[int] = []

    def inline(session: Session, request: GetChunkSize) -> Later:
        started.append(1)
        return Later(lambda: gate(session, request))

    server.state.register_inline(GetChunkSize, inline)
    await raw.send_multipart(encode_request(1, GetChunkSize()))
    await raw.send_multipart(encode_request(2, Ping()))
    await await_condition(lambda: gate.entered == 1, what="the Later part to start")
    assert started == [1]
    gate.release.set()
    assert await _replies_in_order(raw, 2) == [(1, "get_chunk_size"), (2, "ping")]


class SessionSteps:
    """Counts the scheduling rounds of session tasks."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.startswith("kvtrio session"):
            self.steps += 1


async def test_requests_of_an_idle_session_never_wake_its_task(
    server: ServerHandle, raw: Socket
) -> None:
    # Answered inline by the router: no round trip through the session's task (and its queue).
    await raw.send_multipart(encode_request(0, Ping()))
    assert await _replies_in_order(raw, 1) == [(0, "ping")]
    await trio.testing.wait_all_tasks_blocked()  # the session's task is parked
    counter = SessionSteps()
    trio.lowlevel.add_instrument(counter)
    try:
        for call_id in range(1, 101):
            await raw.send_multipart(encode_request(call_id, Ping()))
            assert await _replies_in_order(raw, 1) == [(call_id, "ping")]
    finally:
        trio.lowlevel.remove_instrument(counter)
    assert counter.steps == 0


@pytest.mark.parametrize("server_config", [{"session_queue_size": 2}], indirect=True)
async def test_a_full_session_queue_answers_busy(server: ServerHandle, raw: Socket) -> None:
    gate = Gate()
    server.state.register(GetChunkSize, gate)
    for call_id in range(1, 6):
        await raw.send_multipart(encode_request(call_id, GetChunkSize()))
    await await_condition(lambda: gate.entered == 1, what="the first request to start")
    replies: dict[int, tuple[str, object]] = {}

    async def collect(count: int) -> None:
        while len(replies) < count:
            header_frame, body = await raw.recv_multipart()
            h = decode_reply_header(header_frame)
            assert h.call_id not in replies
            replies[h.call_id] = (h.kind, msgpack.unpackb(body))

    with trio.fail_after(5):
        await collect(2)  # at most 1 in the handler + 2 queued: the rest is refused at once
        gate.release.set()
        await collect(5)
    kinds = [kind for kind, _ in replies.values()]
    codes = {body["code"] for kind, body in replies.values() if kind == "error"}  # type: ignore[index]
    assert codes == {"busy"}
    assert 2 <= kinds.count("get_chunk_size") <= 3


@pytest.mark.parametrize("server_config", [{"heartbeat_timeout": 0.3}], indirect=True)
async def test_a_silent_session_expires_and_is_cleaned_up(
    server: ServerHandle, raw: Socket
) -> None:
    cleaned = trio.Event()

    async def with_cleanup(session: Session, request: GetChunkSize) -> ChunkSize:
        async def cleanup() -> None:
            await trio.lowlevel.checkpoint()
            cleaned.set()

        session.add_cleanup(cleanup)
        return ChunkSize(1)

    server.state.register(GetChunkSize, with_cleanup)
    await raw.send_multipart(encode_request(1, GetChunkSize()))
    await raw.recv_multipart()
    assert len(server.state.sessions) == 1
    with trio.fail_after(5):
        await cleaned.wait()
    await await_condition(lambda: not server.state.sessions, what="the session to be forgotten")
    assert server.state.counters.sessions_expired == 1


@pytest.mark.parametrize("server_config", [{"heartbeat_timeout": 0.3}], indirect=True)
async def test_requests_of_an_expired_session_still_get_one_reply(
    server: ServerHandle, raw: Socket
) -> None:
    gate = Gate()  # never released: the request is in flight when the session expires
    server.state.register(GetChunkSize, gate)
    await raw.send_multipart(encode_request(1, GetChunkSize()))
    await raw.send_multipart(encode_request(2, GetChunkSize()))  # queued behind it
    replies = {}
    with trio.fail_after(5):
        while len(replies) < 2:
            header_frame, body = await raw.recv_multipart()
            replies[decode_reply_header(header_frame).call_id] = msgpack.unpackb(body)
    assert {r["code"] for r in replies.values()} == {"session_ended"}
    assert "heartbeat timeout" in replies[1]["message"]
    # The client is alive after all: its next request starts a new session.
    await raw.send_multipart(encode_request(3, Ping()))
    with trio.fail_after(5):
        header_frame, _ = await raw.recv_multipart()
    assert decode_reply_header(header_frame).kind == "ping"


@pytest.mark.parametrize("server_config", [{"heartbeat_timeout": 0.3}], indirect=True)
async def test_heartbeats_keep_a_session_alive(server: ServerHandle) -> None:
    async with open_client(server.endpoint) as client:
        await client.wait_connected()
        await trio.sleep(1.0)  # three heartbeat timeouts of idleness; the client pings itself
        assert server.state.counters.sessions_expired == 0
        (session,) = (await stats(client)).sessions
        assert session.client_name == "kvtrio-async-client"


async def test_drain_answers_in_flight_requests_then_stops(server_config: ServerConfig) -> None:
    gate = Gate()
    async with trio.open_nursery() as nursery:
        server: ServerHandle = await nursery.start(serve, server_config)
        server.state.register(GetChunkSize, gate)
        async with open_client(server.endpoint) as client, trio.open_nursery() as inner:
            results: list[object] = []

            async def in_flight() -> None:
                results.append(await client.request(GetChunkSize()))

            inner.start_soon(in_flight)
            await await_condition(lambda: gate.entered == 1, what="the request to start")
            inner.start_soon(server.shutdown, 5.0)
            await await_condition(lambda: server.state.draining, what="draining")
            with pytest.raises(ShuttingDown):
                await client.request(Ping())
            gate.release.set()
            await await_condition(lambda: results, what="the in-flight reply")
            assert results == [ChunkSize(1)]
    # the nursery exited: serve() returned after the drain


async def test_drain_gives_up_after_the_grace_period(server_config: ServerConfig) -> None:
    gate = Gate()  # never released
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server: ServerHandle = await nursery.start(serve, server_config)
            server.state.register(GetChunkSize, gate)
            async with (
                open_client(server.endpoint, timeout=5) as client,
                trio.open_nursery() as requests,
            ):

                async def never_answered() -> None:
                    with pytest.raises(ShuttingDown, match="stopped before answering"):
                        await client.request(GetChunkSize())

                requests.start_soon(never_answered)
                await await_condition(lambda: gate.entered == 1, what="the request to start")
                await server.shutdown(0.2)
                assert server.state.pending >= 1  # (the client's hello may be queued behind it)
