"""Thousands of random and mutated frames against a live server process.

Every message whose header carries a readable call id gets exactly one reply, never an
``internal`` error; the rest are dropped and counted; the server keeps answering ping. And every
field of every request at and beyond its declared bounds (``FIELD_BOUNDS``, issue 32): a value
outside gets exactly one error reply, ``bad_request`` naming the field (or
``message_too_large`` for a value larger than the message limit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrio.launch import ServerProcess
from kvtrio.protocol import (
    PROTOCOL_VERSION,
    REQUEST_TYPES,
    GetStats,
    Hello,
    Ping,
    decode_reply_header,
    encode_request,
)

from .._support.bounds import boundary_cases

BARRIER_ID = 2**64 - 1
OPS = [cls.op for cls in REQUEST_TYPES]

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=12,
)


@st.composite
def well_headed(draw: st.DrawFn) -> tuple[list[bytes], int]:
    """A readable header (so exactly one reply is due) with any op, body and frame count."""
    call_id = draw(st.integers(0, BARRIER_ID - 1))
    op = draw(st.sampled_from(OPS) | st.text(max_size=30))
    version = draw(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 2, 2**40]))
    body = draw(
        st.builds(msgpack.packb, msgpack_values)
        | st.builds(msgpack.packb, st.dictionaries(st.text(max_size=20), msgpack_values))
        | st.binary(max_size=40)
    )
    extra = draw(st.lists(st.binary(max_size=8), max_size=2))
    frames = [msgpack.packb([version, call_id, op]), body, *extra]
    if draw(st.booleans()) and not extra:
        frames = frames[:1]  # truncated: the body frame is missing
    return frames, call_id


@st.composite
def mutated(draw: st.DrawFn) -> tuple[list[bytes], int | None]:
    """A valid request with bytes flipped, cut or appended; a reply is due if the header held."""
    call_id = draw(st.integers(0, BARRIER_ID - 1))
    request = draw(st.sampled_from([Ping(), GetStats(), Hello("fuzz", "1", PROTOCOL_VERSION)]))
    frames = [bytearray(f) for f in encode_request(call_id, request)]
    index = draw(st.integers(0, len(frames) - 1))
    target = frames[index]
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "cut", "append"]))
        if action == "flip" and target:
            pos = draw(st.integers(0, len(target) - 1))
            target[pos] ^= draw(st.integers(1, 255))
        elif action == "cut" and target:
            del target[draw(st.integers(0, len(target) - 1)) :]
        else:
            target.extend(draw(st.binary(min_size=1, max_size=8)))
    result = [bytes(f) for f in frames]
    due = call_id if index == 1 else None  # a mangled header may or may not stay readable
    return result, due


garbage = st.lists(st.binary(max_size=64), min_size=1, max_size=4).map(lambda f: (f, None))


@pytest.fixture
def fuzz_socket(server_process: Callable[..., ServerProcess]) -> Iterator[zmq.Socket[bytes]]:
    server = server_process("--max-message-size", "1MiB")
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(server.endpoint)
    yield sock
    sock.send_multipart(encode_request(1, Ping()))
    assert decode_reply_header(sock.recv_multipart()[0]).kind == "ping", "the server died"
    sock.close(linger=0)


def exchange(sock: zmq.Socket[bytes], frames: list[bytes]) -> list[tuple[int, str, object]]:
    """Send ``frames``, then a ping as a barrier (pings are answered in order); return the
    replies that came before the barrier's."""
    sock.send_multipart(frames)
    sock.send_multipart(encode_request(BARRIER_ID, Ping()))
    replies = []
    while True:
        header_frame, body = sock.recv_multipart()
        header = decode_reply_header(header_frame)
        if header.call_id == BARRIER_ID:
            return replies
        replies.append((header.call_id, header.kind, msgpack.unpackb(body)))


@settings(
    max_examples=2500,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(message=well_headed() | mutated() | garbage)
def test_fuzzed_frames_get_one_reply_or_none(
    fuzz_socket: zmq.Socket[bytes], message: tuple[list[bytes], int | None]
) -> None:
    frames, due = message
    replies = exchange(fuzz_socket, frames)
    assert len(replies) <= 1, replies
    if due is not None:
        assert [r[0] for r in replies] == [due]
    for _, kind, body in replies:
        if kind == "error":
            assert isinstance(body, dict)
            assert body["code"] != "internal", body


def test_every_field_at_and_beyond_its_declared_bounds(fuzz_socket: zmq.Socket[bytes]) -> None:
    """Each client-sent field at min-1, min, max, max+1 and a huge value (issue 32: a
    ``num_readers`` of -3 was a hit that unpinned other engines' chunks)."""
    refused = 0
    for call_id, (label, op, body, ok) in enumerate(boundary_cases(), start=1):
        header = msgpack.packb([PROTOCOL_VERSION, call_id, op])
        replies = exchange(fuzz_socket, [header, body])
        assert [r[0] for r in replies] == [call_id], label
        _, kind, reply = replies[0]
        if kind == "error":
            assert isinstance(reply, dict)
            assert reply["code"] != "internal", (label, reply)
        if not ok:
            assert kind == "error", (label, reply)
            assert isinstance(reply, dict)
            assert reply["code"] in ("bad_request", "message_too_large"), (label, reply)
            field = label.split("=")[0].split(".")[-1]
            if reply["code"] == "bad_request":
                assert field in reply["message"], (label, reply)
            refused += 1
    assert refused == sum(not ok for *_, ok in boundary_cases())
