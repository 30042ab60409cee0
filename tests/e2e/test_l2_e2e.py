"""End to end through L2: what one server process stored, the next one serves, byte for byte.

Each backend of the cascade is exercised on its own (with an empty disk, where it is not
``disk``): store through a worker process, wait for the write-behind, restart the server, look
up (the hits come from L2), retrieve into other blocks, compare every layer's bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtrio.client import SchedulerAdapter
from kvtrio.launch import ServerProcess

from .._support.e2e import (
    BLOCK,
    CHUNK,
    PROMPT,
    SOURCE,
    TARGET,
    Worker,
    assert_same_bytes,
    cache,
    chunk_blocks,
    lookup,
    stats,
)
from .._support.waiting import wait_for


def l2_stores(server: ServerProcess) -> float:
    (backend,) = stats(server).l2
    return backend.counters.get("stores", 0)


def restart_and_check(server: ServerProcess, worker_flags: tuple[str, ...] = ()) -> None:
    worker = Worker(server.endpoint, "m", 1, 0, "flash_attn", worker_flags)
    try:
        worker.wait_registered()
        worker("fill", seed=21)
        before = [worker.digests(chunk_blocks(SOURCE, c)) for c in range(10)]
        worker.store("first", PROMPT, SOURCE)
        wait_for(lambda: l2_stores(server) >= 10, what="the write-behind to L2")

        server.stop()
        server.start()  # a new process: an empty L1
        worker.wait_registered()
        sched = SchedulerAdapter(server.endpoint, "m", 1, 0, BLOCK, timeout=5.0)
        try:
            wait_for(lambda: sched.client.server_info is not None, what="the scheduler")
            assert lookup(sched, "second", PROMPT) == 10 * CHUNK
            assert cache(server).lookup_l2_chunks == 10
            assert worker.retrieve("second", PROMPT, TARGET, end=10 * CHUNK) == []
            assert_same_bytes(worker, before, TARGET, 10)
            sched.end_session("second")
            wait_for(lambda: cache(server).l1_pins == 0, what="every pin released")
        finally:
            sched.close()
    finally:
        worker.close()


def test_store_restart_then_hits_come_from_disk(
    server_process: Callable[..., ServerProcess], short_dir: Path
) -> None:
    server = server_process("--l2", f"disk:path={short_dir / 'l2'}")
    restart_and_check(server)


# --------------------------------------------------------------------------- Redis and S3


@pytest.fixture(scope="module")
def redis() -> Iterator[Any]:
    from .._support.redis_servers import ensure_redis_installed, redis_server

    ensure_redis_installed()
    with redis_server() as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[Any]:
    from .._support.redis_servers import ensure_redis_installed
    from .._support.redis_servers import redis_cluster as cluster

    ensure_redis_installed()
    with cluster(masters=3) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    from .._support.seaweedfs import seaweedfs

    with seaweedfs() as server:
        yield server


def test_hits_come_from_redis_with_an_empty_disk(
    server_process: Callable[..., ServerProcess], redis: Any
) -> None:
    server = server_process("--l2", f"redis:url={redis.url},prefix=e2e-{os.getpid()}:")
    restart_and_check(server)


def test_hits_come_from_a_redis_cluster(
    server_process: Callable[..., ServerProcess], redis_cluster: Any
) -> None:
    server = server_process("--l2", f"redis:url={redis_cluster.url},cluster=true")
    restart_and_check(server)


def test_hits_come_from_s3(server_process: Callable[..., ServerProcess], s3: Any) -> None:
    spec = (
        f"s3:bucket=kvtrio-e2e,endpoint={s3.endpoint},region={s3.region},allow_http=true,"
        f"create_bucket=true,access_key_id={s3.access_key_id},"
        f"secret_access_key={s3.secret_access_key}"
    )
    server = server_process("--l2", spec)
    restart_and_check(server)


def test_redis_killed_mid_run_the_server_keeps_serving_and_recovers(
    server_process: Callable[..., ServerProcess], redis: Any
) -> None:
    server = server_process("--l2", f"redis:url={redis.url},prefix=kill-{os.getpid()}:,timeout=1")
    worker = Worker(server.endpoint, "m", 1, 0, "flash_attn", ())
    sched = SchedulerAdapter(server.endpoint, "m", 1, 0, BLOCK, timeout=5.0)
    try:
        worker.wait_registered()
        worker.store("a", PROMPT[: 2 * CHUNK], SOURCE)
        wait_for(lambda: l2_stores(server) >= 2, what="the first write-behind")

        redis.stop(kill=True)
        other = [3] * (4 * CHUNK)
        worker.store("b", other, SOURCE)  # L1 takes it; writing it to Redis fails, counted
        assert lookup(sched, "c", other) == 4 * CHUNK
        wait_for(lambda: not stats(server).l2[0].healthy, what="Redis marked down")
        assert stats(server).l2[0].counters["errors"] >= 1

        redis.start()  # back, empty (no persistence)
        wait_for(lambda: stats(server).l2[0].healthy, timeout=60, what="Redis used again")
        third = [5] * (3 * CHUNK)
        worker.store("d", third, SOURCE)
        wait_for(lambda: l2_stores(server) >= 5, timeout=30, what="writes to Redis again")
        server.stop()
        server.start()
        worker.wait_registered()
        wait_for(lambda: sched.client.connected, what="the scheduler to reconnect")
        assert lookup(sched, "e", third) == 3 * CHUNK  # from Redis, after it came back
    finally:
        sched.close()
        worker.close()
