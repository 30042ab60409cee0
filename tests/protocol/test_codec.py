"""The codec: every message round-trips, and every malformed input is a readable ProtocolError."""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtrio.errors import ErrorCode, ProtocolError
from kvtrio.protocol import (
    PROTOCOL_VERSION,
    ChunkSize,
    ErrorReply,
    GetChunkSize,
    GetStats,
    Header,
    HeaderError,
    Hello,
    HelloReply,
    Ping,
    Pong,
    Probe,
    ProbeReply,
    ServerCounters,
    SessionStats,
    StatsReply,
    as_int_array,
    decode_header,
    decode_reply,
    decode_reply_header,
    decode_request,
    encode_error,
    encode_reply,
    encode_request,
    read_request_header,
)

REQUESTS = [
    Ping(),
    Hello("engine", "1.2", PROTOCOL_VERSION),
    GetChunkSize(),
    GetStats(),
    Probe(tuple(range(256)), tuple(range(64))),
]
STATS = StatsReply(
    server_version="0.1.0",
    instance_id="abc",
    uptime_seconds=1.5,
    counters=ServerCounters(3, 1, {"bad_request": 1}, 0, 0, 1, 0, 0),
    sessions=(SessionStats("00ff", "engine", "1.2", 1.0, 0.5, 3, 1, 0),),
)
REPLIES = [
    (Ping(), Pong("abc")),
    (Hello("e", "1", 1), HelloReply("0.1.0", 1, "abc", 256, 10.0, 1 << 24)),
    (GetChunkSize(), ChunkSize(256)),
    (GetStats(), STATS),
    (Probe((1,), ()), ProbeReply(1, 0)),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.op)
def test_requests_round_trip(request_: object) -> None:
    header_frame, body = encode_request(42, request_)  # type: ignore[arg-type]
    header = decode_header(header_frame)
    assert header == Header(PROTOCOL_VERSION, 42, request_.op)  # type: ignore[attr-defined]
    assert decode_request(header.kind, body) == request_


@pytest.mark.parametrize(("request_", "reply"), REPLIES, ids=lambda r: type(r).__name__)
def test_replies_round_trip(request_: object, reply: object) -> None:
    header_frame, body = encode_reply(7, request_.op, reply)  # type: ignore[attr-defined,arg-type]
    header = decode_reply_header(header_frame)
    assert (header.call_id, header.kind) == (7, request_.op)  # type: ignore[attr-defined]
    assert decode_reply(header, body, type(request_)) == reply  # type: ignore[arg-type]


def test_error_reply_round_trips() -> None:
    header_frame, body = encode_error(9, ErrorCode.BUSY, "slow down")
    header = decode_reply_header(header_frame)
    assert header.kind == "error"
    assert decode_reply(header, body, Ping) == ErrorReply("busy", "slow down")


@given(call_id=st.integers(0, 2**64 - 1), name=st.text(max_size=50), version=st.text(max_size=20))
def test_hello_round_trips_any_strings_and_ids(call_id: int, name: str, version: str) -> None:
    frames = encode_request(call_id, Hello(name, version, PROTOCOL_VERSION))
    header = decode_header(frames[0])
    assert header.call_id == call_id
    assert decode_request(header.kind, frames[1]) == Hello(name, version, PROTOCOL_VERSION)


# --------------------------------------------------------------------------- headers


@pytest.mark.parametrize(
    ("frame", "call_id", "fragment"),
    [
        (b"\xc1", None, "not valid msgpack"),
        (msgpack.packb({"a": 1}), None, "array"),
        (msgpack.packb([1]), None, "array"),
        (msgpack.packb([PROTOCOL_VERSION, -1, "ping"]), None, "unsigned"),
        (msgpack.packb([PROTOCOL_VERSION, "x", "ping"]), None, "unsigned"),
        (msgpack.packb([PROTOCOL_VERSION, 1.5, "ping"]), None, "unsigned"),
        (msgpack.packb([PROTOCOL_VERSION, 5]), 5, "array"),
        (msgpack.packb([PROTOCOL_VERSION, 5, "ping", 0]), 5, "array"),
        (msgpack.packb(["1", 5, "ping"]), 5, "version must be an integer"),
        (msgpack.packb([float(PROTOCOL_VERSION), 5, "ping"]), 5, "version must be an integer"),
        (msgpack.packb([PROTOCOL_VERSION, True, "ping"]), None, "unsigned"),
        (msgpack.packb([PROTOCOL_VERSION, 5, 3]), 5, "operation name must be a string"),
        (msgpack.packb([PROTOCOL_VERSION, 5, "ping"]) + b"\x00", None, "not valid msgpack"),
    ],
)
@pytest.mark.parametrize("decode", [decode_header, read_request_header])
def test_bad_headers(
    frame: bytes, call_id: int | None, fragment: str, decode: Callable[[bytes], object]
) -> None:
    with pytest.raises(HeaderError, match=fragment) as info:
        decode(frame)
    assert info.value.call_id == call_id
    assert info.value.code is ErrorCode.BAD_REQUEST


def test_the_servers_header_reader_builds_no_header_object() -> None:
    frame = msgpack.packb([PROTOCOL_VERSION, 2**64 - 1, "lookup"])
    assert read_request_header(frame) == (2**64 - 1, "lookup")
    assert decode_header(frame).call_id == 2**64 - 1


def test_other_protocol_version_is_refused_with_the_call_id() -> None:
    with pytest.raises(HeaderError, match="speaks protocol version 99") as info:
        decode_header(msgpack.packb([99, 5, "ping"]))
    assert info.value.call_id == 5
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION


# --------------------------------------------------------------------------- bodies


def test_unknown_operation() -> None:
    with pytest.raises(ProtocolError, match="unknown operation 'frobnicate'") as info:
        decode_request("frobnicate", msgpack.packb({}))
    assert info.value.code is ErrorCode.UNKNOWN_OPERATION


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([PROTOCOL_VERSION, 2]), "must be a msgpack map, got an array"),
        (msgpack.packb({}), "required field missing @ body.client_name"),
        (
            msgpack.packb({"client_name": 1, "client_version": "1", "protocol_version": 1}),
            "expected a string, got an integer @ body.client_name",
        ),
        (
            msgpack.packb({"client_name": "a", "client_version": "1", "protocol_version": True}),
            "expected an integer, got a boolean @ body.protocol_version",
        ),
        (
            msgpack.packb({"client_name": "a", "client_version": "1", "protocol_version": 1.0}),
            "expected an integer, got a float @ body.protocol_version",
        ),
    ],
)
def test_bad_hello_bodies(body: bytes, fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment) as info:
        decode_request("hello", body)
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert str(info.value).startswith("invalid 'hello' request")


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    body = msgpack.packb({"client_name": "a", "client_version": "1", "protocol_version": 1, "x": 2})
    assert decode_request("hello", body) == Hello("a", "1", 1)


def test_reply_of_the_wrong_operation_is_refused() -> None:
    header_frame, body = encode_reply(1, "ping", Pong("x"))
    with pytest.raises(ProtocolError, match="expected a 'stats' reply"):
        decode_reply(decode_reply_header(header_frame), body, GetStats)


def test_int_arrays_are_checked_when_packed() -> None:
    assert list(as_int_array((1, 2, 3), "q", "tokens")) == [1, 2, 3]
    with pytest.raises(ProtocolError, match="tokens: every element must be an integer"):
        as_int_array((1, "2"), "q", "tokens")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="block_ids"):
        as_int_array((2**70,), "q", "block_ids")


def test_int_arrays_must_be_arrays() -> None:
    body = msgpack.packb({"tokens": 5, "block_ids": []})
    with pytest.raises(ProtocolError, match="expected an array of integers, got an integer"):
        decode_request("probe", body)


def test_a_lookup_reply_says_its_l1_part_and_an_older_servers_still_decodes() -> None:
    """Issue 33: ``l1_chunks`` is optional, so a reply without it (an older server's) decodes
    as "not said"; an older client ignores it as an unknown field."""
    from kvtrio.protocol import Lookup, LookupBatch, LookupBatchReply, LookupReply

    for request, reply, unsaid in [
        (Lookup("r", "m", 1), LookupReply(512, 2, 1), -1),
        (LookupBatch("m", 1, ("r",), ((),)), LookupBatchReply((512,), (2,), (), (1,)), ()),
    ]:
        header_frame, body = encode_reply(1, request.op, reply)
        decoded = decode_reply(decode_reply_header(header_frame), body, type(request))
        assert decoded.l1_chunks == reply.l1_chunks  # type: ignore[attr-defined]
        old = msgpack.packb({k: v for k, v in msgpack.unpackb(body).items() if k != "l1_chunks"})
        decoded = decode_reply(decode_reply_header(header_frame), old, type(request))
        assert decoded.l1_chunks == unsaid  # type: ignore[attr-defined]


def test_prepare_hooks_makes_every_message_types_hooks_before_its_first_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Clients and servers call it as they start: afterwards no request, reply or error reply
    type asks cattrs for a hook (its code generation took 1-4 ms per type on an engine's first
    request); calling it again changes nothing."""
    from kvtrio.protocol import OPERATIONS, ErrorReply, Lookup, _codec, prepare_hooks

    monkeypatch.setattr(_codec, "_STRUCTURE", {})
    monkeypatch.setattr(_codec, "_UNSTRUCTURE", {})
    prepare_hooks()
    expected = {ErrorReply} | set(OPERATIONS.values())
    expected |= {cls.reply_type for cls in OPERATIONS.values()}
    assert set(_codec._STRUCTURE) == expected
    assert set(_codec._UNSTRUCTURE) == expected
    hooks = dict(_codec._STRUCTURE)
    prepare_hooks()
    assert hooks == _codec._STRUCTURE

    def no_new_hooks(*_: object) -> None:
        raise AssertionError("a hook was made after prepare_hooks")

    monkeypatch.setattr(_codec.converter, "get_structure_hook", no_new_hooks)
    monkeypatch.setattr(_codec.converter, "get_unstructure_hook", no_new_hooks)
    _, body = encode_request(7, Lookup("r", "m", 1))
    assert decode_request("lookup", body) == Lookup("r", "m", 1)
