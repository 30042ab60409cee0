"""Clients say goodbye when they close: their session ends at once, not at the heartbeat
timeout, and is counted as ended, not expired."""

from __future__ import annotations

from collections.abc import Callable

from kvtrio.client import Client, open_client
from kvtrio.launch import ServerProcess
from kvtrio.protocol import GetStats, Ping, StatsReply
from kvtrio.server import ServerHandle

from .._support.waiting import await_condition, wait_for


async def test_the_trio_client_ends_its_session_on_close(server: ServerHandle) -> None:
    async with open_client(server.endpoint, client_name="short-lived") as client:
        await client.request(Ping())
        assert len(server.state.sessions) == 1
    await await_condition(lambda: not server.state.sessions, what="the session to end")
    assert server.state.counters.sessions_ended == 1
    assert server.state.counters.sessions_expired == 0


def test_ping_and_status_leave_no_session_behind(
    server_process: Callable[..., ServerProcess],
) -> None:
    from .._support.command import run

    server = server_process("--heartbeat-timeout", "60")
    for command in ("ping", "status", "ping"):
        assert run(command, server.endpoint).returncode == 0
    with Client(server.endpoint, heartbeat=False) as client:

        def only_this_one_is_live() -> bool:
            stats = client.call(GetStats(), StatsReply)
            return len(stats.sessions) == 1 and stats.counters.sessions_ended >= 3

        wait_for(only_this_one_is_live, what="the short-lived clients' sessions to end")
        stats = client.call(GetStats(), StatsReply)
        assert stats.counters.sessions_expired == 0
    server.stop()
    assert "ended (goodbye)" in server.log()
