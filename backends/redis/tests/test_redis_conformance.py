"""The L2 conformance suite against real Redis servers, exactly as a third party runs it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from kvtrio_redis import RedisBackend, RedisOptions

from kvtrio.l2 import Backend
from kvtrio.testing import BackendConformance
from kvtrio.testing._redis import LocalRedis, LocalRedisCluster


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
