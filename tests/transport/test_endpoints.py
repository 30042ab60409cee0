"""Endpoint spelling: what is accepted, what is refused, and the hints for near misses."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import zmq

from kvtrio.errors import TransportError
from kvtrio.transport import check_endpoint, open_socket
from kvtrio.transport._endpoints import remove_socket_file, socket_file


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://127.0.0.1:5577", "tcp://localhost:1", "tcp://[::1]:65535", "ipc:///tmp/k.sock"],
)
def test_good_endpoints_pass_unchanged(endpoint: str) -> None:
    assert check_endpoint(endpoint) == endpoint
    assert check_endpoint(endpoint, bind=True) == endpoint


def test_listening_takes_any_port_and_any_interface() -> None:
    assert check_endpoint("tcp://127.0.0.1:0", bind=True) == "tcp://127.0.0.1:0"
    assert check_endpoint("tcp://*:5577", bind=True) == "tcp://*:5577"
    for endpoint in ("tcp://127.0.0.1:0", "tcp://*:5577"):
        with pytest.raises(TransportError):
            check_endpoint(endpoint)


@pytest.mark.parametrize(
    ("endpoint", "hint"),
    [
        ("127.0.0.1:5577", "did you mean tcp://127.0.0.1:5577?"),
        ("localhost:5577", "did you mean tcp://localhost:5577?"),
        (":5577", "did you mean tcp://127.0.0.1:5577?"),
        ("5577", "did you mean tcp://127.0.0.1:5577?"),
        ("http://10.0.0.2:5577/", "not http://; did you mean tcp://10.0.0.2:5577?"),
        ("redis://cache:6379/0", "not redis://; did you mean tcp://cache:6379?"),
    ],
)
def test_near_misses_get_a_hint(endpoint: str, hint: str) -> None:
    with pytest.raises(TransportError) as raised:
        check_endpoint(endpoint)
    assert str(raised.value).endswith(hint)


@pytest.mark.parametrize(
    ("endpoint", "fragment"),
    [
        ("", "no endpoint given"),
        ("nonsense", "is not an endpoint"),
        ("tcp://nonsense", "is not tcp://HOST:PORT"),
        ("tcp://:5577", "is not tcp://HOST:PORT"),
        ("tcp://127.0.0.1:99999", "the port must be a number from"),  # libzmq binds 34463
        ("tcp://127.0.0.1:65536", "the port must be a number from"),
        ("tcp://127.0.0.1:abc", "the port must be a number from"),
        ("tcp://127.0.0.1:5577/x", "the port must be a number from"),
        ("ipc://", "names no path"),
        ("ipc:///" + "d" * 120, "longer than 107 bytes"),
        ("udp://x", "not udp://"),
    ],
)
def test_malformed_endpoints_are_refused_in_one_line(endpoint: str, fragment: str) -> None:
    for bind in (False, True):
        with pytest.raises(TransportError) as raised:
            check_endpoint(endpoint, bind=bind)
        assert fragment in str(raised.value)
        assert "\n" not in str(raised.value)


async def test_a_closed_socket_removes_its_ipc_file(short_dir: Path) -> None:
    """Issue 32: libzmq left the socket files of a cleanly stopped server behind."""
    path = short_dir / "s.sock"
    async with open_socket(zmq.ROUTER) as sock:
        sock.bind(f"ipc://{path}")
        assert path.exists()
    assert not path.exists()


def test_a_socket_file_bound_since_by_another_is_left_alone(short_dir: Path) -> None:
    path = short_dir / "s.sock"
    with socket.socket(socket.AF_UNIX) as first:
        first.bind(str(path))
        ours = socket_file(str(path))
    assert ours is not None
    path.unlink()
    with socket.socket(socket.AF_UNIX) as other:  # another server bound the path since
        other.bind(str(path))
        remove_socket_file(ours)
        assert path.exists()
        theirs = socket_file(str(path))
        assert theirs is not None
        remove_socket_file(theirs)  # (the same file: gone)
        assert not path.exists()
    remove_socket_file(theirs)  # (nothing there: no error)
    assert socket_file(str(short_dir / "nothing")) is None
