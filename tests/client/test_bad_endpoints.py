"""A mistyped endpoint fails where it is given, at once, instead of hanging the client."""

from __future__ import annotations

import time

import pytest

from kvtrio.client import Client, open_client
from kvtrio.errors import TransportError

BAD = ["127.0.0.1:5577", "localhost:5577", "http://127.0.0.1:5577", "tcp://nonsense", ""]


@pytest.mark.parametrize("endpoint", BAD)
def test_sync_client_raises_at_construction(endpoint: str) -> None:
    started = time.monotonic()
    with pytest.raises(TransportError):
        Client(endpoint)
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("endpoint", BAD)
async def test_async_client_raises_before_connecting(endpoint: str) -> None:
    with pytest.raises(TransportError):
        async with open_client(endpoint):
            pytest.fail("open_client accepted a malformed endpoint")  # pragma: no cover


def test_sync_client_raises_if_libzmq_refuses_what_the_check_let_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A second line of defence: the I/O thread's connect error reaches the constructor.
    monkeypatch.setattr("kvtrio.client._sync.check_endpoint", lambda endpoint: endpoint)
    with pytest.raises(TransportError, match="cannot connect to localhost:5577: Invalid argument"):
        Client("localhost:5577")
