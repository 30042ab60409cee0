"""When both clients ping (``kvtrio.client._common``): one rule for the trio client's heartbeat
task and the sync client's background thread; and what they do while the server is away."""

from __future__ import annotations

import time

import pytest
import trio

import kvtrio.client._async as async_client
from kvtrio.client import AsyncClient, Client, open_client
from kvtrio.client._common import DEFAULT_HEARTBEAT_INTERVAL, heartbeat_interval, ping_due
from kvtrio.config import ServerConfig
from kvtrio.errors import ClientClosed
from kvtrio.protocol import PROTOCOL_VERSION, HelloReply, Ping
from kvtrio.server import serve

from .._support.waiting import await_condition, wait_for

INFO = HelloReply("test", PROTOCOL_VERSION, "server", 256, 8.0, 1 << 20)  # heartbeat timeout 8 s


def test_the_interval_is_a_quarter_of_the_servers_timeout_once_it_said_hello() -> None:
    assert heartbeat_interval(None) == DEFAULT_HEARTBEAT_INTERVAL
    assert heartbeat_interval(INFO) == 2.0


def test_a_ping_is_due_only_after_an_interval_without_sending() -> None:
    assert not ping_due(101.9, 100.0, INFO)
    assert ping_due(102.0, 100.0, INFO)
    assert ping_due(100.0 + DEFAULT_HEARTBEAT_INTERVAL, 100.0, None)


def test_the_sync_clients_thread_sleeps_while_the_server_is_away(endpoint: str) -> None:
    """Nothing is sent while the server is away, so the heartbeat is due at every wake: was a
    poll of 0 ms in a loop (a core, and the engine's GIL, for the whole outage: 96,000 wakes a
    second). Once the ping is overdue the thread still sleeps up to 1 s."""
    with Client(endpoint) as client:  # nobody serves the endpoint (an engine before its server)
        shared, conn = client._shared, client._conn
        assert conn is not None
        due = conn.last_send + heartbeat_interval(None)
        wait_for(lambda: time.monotonic() > due + 0.1, what="the ping to be overdue")
        wait_for(lambda: shared.background_wakes_at > due + 0.5, what="a sleep past the due ping")
        assert shared.status != "connected"


async def test_the_trio_clients_heartbeat_sleeps_while_the_server_is_away(
    nursery: trio.Nursery, server_config: ServerConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trio client's heartbeat task slept until a time already past, over and over."""
    rounds = [0]

    def counted(info: HelloReply | None) -> float:
        rounds[0] += 1
        return heartbeat_interval(info)

    monkeypatch.setattr(async_client, "heartbeat_interval", counted)
    server = await nursery.start(serve, server_config)
    async with open_client(server.endpoint) as client:
        await client.wait_connected()
        server.stop()
        await await_condition(lambda: not client.connected, what="the connection to drop")
        interval = heartbeat_interval(client.server_info)
        await trio.sleep_until(client._last_send + interval + 0.1)  # (the ping overdue)
        before = rounds[0]
        await trio.sleep(0.2)  # (a window to count the heartbeat task's rounds in)
        assert rounds[0] - before <= 1


async def test_a_request_waiting_for_a_connection_ends_when_the_client_closes(
    endpoint: str,
) -> None:
    """Was: it waited out its whole timeout, then raised ``ClientClosed``."""
    failed: list[BaseException] = []

    async def request(client: AsyncClient) -> None:
        with pytest.raises(ClientClosed) as info:
            await client.request(Ping(), timeout=30)
        failed.append(info.value)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery, open_client(endpoint) as client:
            nursery.start_soon(request, client)  # (nobody serves the endpoint)
            await await_condition(lambda: client._calls, what="the request to wait")
    assert len(failed) == 1
