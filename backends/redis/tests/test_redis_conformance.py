"""The L2 conformance suite against real Redis servers, exactly as a third party runs it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from kvtrio_redis import RedisBackend, RedisOptions

from kvtrio.l2 import Backend
from kvtrio.testing import BackendConformance
from tests._support.redis_servers import LocalRedis, LocalRedisCluster


class TestRedis(BackendConformance):
    # Redis may evict (maxmemory) or expire (ttl) a locked object: then a load is a miss.
    protects_locked_objects = False

    @pytest.fixture
    async def backend(self, standalone: LocalRedis) -> AsyncIterator[Backend]:
        backend = RedisBackend(RedisOptions(url=standalone.url))
        yield backend
        await backend.aclose()


class TestRedisLargeObjects(TestRedis):
    """Objects of several socket reads each, of an odd size (the replies span many recvs)."""

    object_size = (3 << 20) + 7


class TestRedisCluster(BackendConformance):
    protects_locked_objects = False

    @pytest.fixture
    async def backend(self, cluster: LocalRedisCluster) -> AsyncIterator[Backend]:
        backend = RedisBackend(RedisOptions(url=cluster.url, cluster=True))
        yield backend
        await backend.aclose()


_SERVERS: dict[int, LocalRedis] = {}


class TestRedisFaults(BackendConformance):
    """Real faults on a Redis of the test's own: out of memory (``maxmemory``, noeviction) and
    a stopped server (restarted empty: no persistence)."""

    protects_locked_objects = False
    fault_kinds = ("full", "unavailable")

    @pytest.fixture
    async def backend(self, private_redis: LocalRedis) -> AsyncIterator[Backend]:
        backend = RedisBackend(RedisOptions(url=private_redis.url, timeout=1))
        _SERVERS[id(backend)] = private_redis  # (pytest binds fixtures to another instance)
        yield backend
        del _SERVERS[id(backend)]
        await backend.aclose()

    @asynccontextmanager
    async def fault(self, backend: Backend, kind: str) -> AsyncIterator[None]:
        redis = _SERVERS[id(backend)]
        if kind == "full":
            redis.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
            redis.command("CONFIG", "SET", "maxmemory", "1")  # fuller than full: refuses writes
            try:
                yield
            finally:
                redis.command("CONFIG", "SET", "maxmemory", "0")
        elif kind == "unavailable":
            await trio.to_thread.run_sync(lambda: redis.stop(kill=True))
            try:
                yield
            finally:
                await trio.to_thread.run_sync(redis.start)
        else:
            raise AssertionError(kind)
