"""Real Redis servers for the backend's tests: one standalone server and one 3-master cluster
per session (started on free loopback ports, stopped by PID), emptied before every test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# kvtrio's test servers are test support in the repository (tests/_support, in no wheel):
# its root goes first on sys.path, so these tests also run from this folder (`pytest` here).
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests._support.redis_servers import LocalRedis, LocalRedisCluster, redis_cluster, redis_server


@pytest.fixture(scope="session")
def session_redis() -> Iterator[LocalRedis]:
    with redis_server() as server:
        yield server


@pytest.fixture(scope="session")
def session_cluster() -> Iterator[LocalRedisCluster]:
    with redis_cluster(masters=3) as cluster:
        yield cluster


@pytest.fixture
def standalone(session_redis: LocalRedis) -> LocalRedis:
    """The session's standalone Redis, empty."""
    if not session_redis.running:  # a test that stopped it failed before restarting it
        session_redis.start()
    session_redis.command("FLUSHALL")
    return session_redis


@pytest.fixture
def cluster(session_cluster: LocalRedisCluster) -> LocalRedisCluster:
    """The session's Redis Cluster, every master empty."""
    session_cluster.flushall()
    return session_cluster


@pytest.fixture
def private_redis() -> Iterator[LocalRedis]:
    """A standalone Redis of the test's own, which it may stop, restart or freeze."""
    with redis_server() as server:
        yield server
