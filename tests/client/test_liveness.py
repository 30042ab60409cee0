"""When both clients ping (``kvtrio.client._common``): one rule for the trio client's heartbeat
task and the sync client's background thread."""

from __future__ import annotations

from kvtrio.client._common import DEFAULT_HEARTBEAT_INTERVAL, heartbeat_interval, ping_due
from kvtrio.protocol import PROTOCOL_VERSION, HelloReply

INFO = HelloReply("test", PROTOCOL_VERSION, "server", 256, 8.0, 1 << 20)  # heartbeat timeout 8 s


def test_the_interval_is_a_quarter_of_the_servers_timeout_once_it_said_hello() -> None:
    assert heartbeat_interval(None) == DEFAULT_HEARTBEAT_INTERVAL
    assert heartbeat_interval(INFO) == 2.0


def test_a_ping_is_due_only_after_an_interval_without_sending() -> None:
    assert not ping_due(101.9, 100.0, INFO)
    assert ping_due(102.0, 100.0, INFO)
    assert ping_due(100.0 + DEFAULT_HEARTBEAT_INTERVAL, 100.0, None)
