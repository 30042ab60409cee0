"""Issue 22: a failed handshake says what happened, and which side speaks what.

Was: "the handshake with the server failed (a wrong server key, or CURVE on one side only…)"
whatever the cause, also when the server was merely killed during the handshake.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvtrio.client import Client, open_client
from kvtrio.client._common import HandshakeWatch
from kvtrio.errors import ServerUnavailable
from kvtrio.protocol import Ping
from kvtrio.transport import write_keypair

from .._support.waiting import wait_for


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP listener on loopback that is not a ZeroMQ peer."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


def _curve_client(endpoint: str, keys: Path) -> Client:
    server = write_keypair(keys, "server")
    write_keypair(keys, "client")
    return Client(
        endpoint,
        timeout=0.5,
        heartbeat=False,
        server_key=server.public.decode(),
        client_key=str(keys / "client.key_secret"),
    )


def test_a_server_killed_during_the_handshake_is_not_called_a_key_problem(
    listener: socket.socket, short_dir: Path
) -> None:
    """The server takes the connection, reads the client's greeting and dies (its port then
    refuses connections): the client says it went away, not that a key is wrong."""
    port = listener.getsockname()[1]

    def die_during_the_handshake() -> None:
        connection, _ = listener.accept()
        connection.recv(64)
        connection.close()
        listener.close()  # killed: nobody listens any more

    killer = threading.Thread(target=die_during_the_handshake)
    killer.start()
    with _curve_client(f"tcp://127.0.0.1:{port}", short_dir) as client:
        wait_for(
            lambda: client.handshake_error is not None and "no longer" in client.handshake_error
        )
        with pytest.raises(ServerUnavailable) as info:
            client.request(Ping(), fail_fast=True)
    killer.join()
    assert "stopped or was killed (not a key problem)" in str(info.value)
    assert "wrong server key" not in str(info.value)


async def test_a_wrong_server_key_is_named_once_the_server_keeps_closing(
    short_dir: Path,
) -> None:
    """A CURVE server whose key is not the one the client expects closes every handshake."""
    real = write_keypair(short_dir / "real", "server")
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.curve_server = True
    router.curve_secretkey = real.secret
    router.curve_publickey = real.public
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        impostor = write_keypair(short_dir / "other", "server")
        write_keypair(short_dir / "other", "client")
        async with open_client(
            f"tcp://127.0.0.1:{port}",
            timeout=0.3,
            server_key=impostor.public.decode(),
            client_key=str(short_dir / "other" / "client.key_secret"),
            heartbeat=False,
        ) as client:
            from .._support.waiting import await_condition

            await await_condition(
                lambda: (
                    client.handshake_error is not None
                    and "every CURVE handshake" in client.handshake_error
                ),
                what="the second closed handshake",
            )
            assert "a wrong server key" in client.handshake_error  # type: ignore[operator]
    finally:
        router.close(0)
        context.term()


def test_the_watch_tells_mismatched_mechanisms_apart() -> None:
    mismatch = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    curve, plain = HandshakeWatch(curve=True), HandshakeWatch(curve=False)
    failed = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    assert "server speaks plain ZeroMQ" in (curve.observe(failed, mismatch) or "")
    assert "server speaks CURVE and this client plain" in (plain.observe(failed, mismatch) or "")
    assert plain.observe(failed, mismatch) is None  # (said once)
    assert plain.observe(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0) is None
    assert plain.error is None
    refused = HandshakeWatch(curve=True)
    assert "refused this client's CURVE key" in (
        refused.observe(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400) or ""
    )
    refused.observe(zmq.EVENT_CLOSED, 0)  # a refusal stays what it was when the server goes
    assert "refused" in (refused.error or "")
