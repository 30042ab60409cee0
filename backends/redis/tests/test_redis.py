"""What the conformance suite does not cover: an unavailable or frozen Redis, expiry, eviction,
refusals, cluster redirects, the fallback reader, options and the entry point, and a server
that is not in the mode ``cluster`` says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from kvtrio_redis import RedisBackend, RedisOptions, _client

from kvtrio.errors import ConfigError
from kvtrio.l2 import (
    HEADER_SIZE,
    BackendError,
    BackendMisconfigured,
    BackendUnavailable,
    create_backend,
    describe_backends,
    header,
    load_backend_class,
)
from tests._support.redis_servers import LocalRedis, LocalRedisCluster, redis_server

FP = b"redis-tests-fp16"


def _key() -> bytes:
    return os.urandom(32)


def _parts(key: bytes, size: int, fill: int = 7) -> list[memoryview]:
    payload = bytes([fill]) * size
    return [memoryview(header(key, FP, payload)), memoryview(payload)]


def _buffers(size: int) -> list[memoryview]:
    return [memoryview(bytearray(HEADER_SIZE)), memoryview(bytearray(size))]


async def _eventually(condition: Callable[[], Any], limit: float, what: str) -> None:
    """Re-check an async ``condition`` with a growing delay until true, within ``limit`` s."""
    delay = 0.01
    with trio.move_on_after(limit):
        while not await condition():
            await trio.sleep(delay)
            delay = min(delay * 2, 0.2)
        return
    pytest.fail(f"timed out after {limit}s waiting for {what}")


@pytest.fixture
async def backend(standalone: LocalRedis) -> AsyncIterator[RedisBackend]:
    backend = RedisBackend(RedisOptions(url=standalone.url))
    yield backend
    await backend.aclose()


# --------------------------------------------------------------------------- availability


async def _every_operation_fails(backend: RedisBackend, limit: float) -> None:
    key = _key()
    operations: list[Callable[[], Awaitable[object]]] = [
        lambda: backend.lookup_and_lock([key]),
        lambda: backend.load([key], [_buffers(10)]),
        lambda: backend.store([key], [_parts(key, 10)]),
        lambda: backend.delete([key]),
    ]
    for operation in operations:
        started = time.monotonic()
        with trio.fail_after(limit + 2), pytest.raises(BackendUnavailable, match=r"^redis "):
            await operation()
        assert time.monotonic() - started < limit + 1
    assert backend.statistics()["locks"] == 0


async def test_a_backend_whose_redis_is_down_works_once_it_is_back(
    private_redis: LocalRedis,
) -> None:
    await trio.to_thread.run_sync(lambda: private_redis.stop(kill=True))
    backend = RedisBackend(RedisOptions(url=private_redis.url, timeout=1))  # does not connect
    await _every_operation_fails(backend, 1)
    await trio.to_thread.run_sync(private_redis.start)
    key = _key()
    assert await backend.store([key], [_parts(key, 1000)]) == [True]
    assert await backend.lookup_and_lock([key]) == 1
    await backend.unlock([key])
    await backend.aclose()


async def test_redis_restarting_under_a_backend(private_redis: LocalRedis) -> None:
    backend = RedisBackend(RedisOptions(url=private_redis.url, timeout=1, connections=2))
    key = _key()
    assert await backend.store([key], [_parts(key, 1000)]) == [True]  # pooled connections now
    await trio.to_thread.run_sync(lambda: private_redis.stop(kill=True))
    await _every_operation_fails(backend, 1)
    await trio.to_thread.run_sync(private_redis.start)  # empty again: no persistence
    assert await backend.lookup_and_lock([key]) == 0  # the stale connections are replaced
    assert await backend.store([key], [_parts(key, 1000)]) == [True]
    assert await backend.load([key], [_buffers(1000)]) == [True]
    assert backend.statistics()["errors"] == 4
    await backend.aclose()


async def test_a_frozen_redis_times_out_within_the_timeout(private_redis: LocalRedis) -> None:
    backend = RedisBackend(RedisOptions(url=private_redis.url, timeout=0.5))
    key = _key()
    assert await backend.store([key], [_parts(key, 1000)]) == [True]
    assert private_redis.pid is not None
    os.kill(private_redis.pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        started = time.monotonic()
        with trio.fail_after(5), pytest.raises(BackendUnavailable, match="Timeout"):
            await backend.load([key], [_buffers(1000)])
        assert 0.4 < time.monotonic() - started < 2
    finally:
        os.kill(private_redis.pid, signal.SIGCONT)
    assert await backend.load([key], [_buffers(1000)]) == [True]
    await backend.aclose()


async def test_a_cluster_backend_constructs_while_the_cluster_is_down() -> None:
    with redis_server() as server:
        url = server.url
    backend = RedisBackend(RedisOptions(url=url, cluster=True, timeout=1))
    with trio.fail_after(5), pytest.raises(BackendUnavailable, match=r"(?i)cluster"):
        await backend.lookup_and_lock([_key()])
    await backend.aclose()


async def test_aclose_is_idempotent_and_later_operations_fail(backend: RedisBackend) -> None:
    await backend.aclose()
    await backend.aclose()
    with pytest.raises(BackendError, match="after aclose"):
        await backend.lookup_and_lock([_key()])
    await backend.unlock([_key()])  # never fails


# --------------------------------------------------------------------------- semantics


async def test_ttl_makes_objects_expire(standalone: LocalRedis) -> None:
    backend = RedisBackend(RedisOptions(url=standalone.url, ttl=0.3, prefix="ttl:"))
    key = _key()
    assert await backend.store([key], [_parts(key, 100)]) == [True]
    ttl_ms = standalone.command("PTTL", b"ttl:" + key.hex().encode())
    assert 0 < ttl_ms <= 300

    async def gone() -> bool:
        return await backend.lookup_and_lock([key]) == 0

    await _eventually(gone, 10, "the object to expire")
    assert await backend.load([key], [_buffers(100)]) == [False]
    await backend.aclose()


async def test_objects_live_under_the_prefix(standalone: LocalRedis) -> None:
    first = RedisBackend(RedisOptions(url=standalone.url, prefix="one:"))
    second = RedisBackend(RedisOptions(url=standalone.url, prefix="two:"))
    key = _key()
    assert await first.store([key], [_parts(key, 100)]) == [True]
    assert standalone.command("EXISTS", b"one:" + key.hex().encode()) == 1
    assert standalone.command("PTTL", b"one:" + key.hex().encode()) == -1  # no ttl: no expiry
    assert await second.lookup_and_lock([key]) == 0
    assert await first.lookup_and_lock([key]) == 1
    await first.unlock([key])
    await first.aclose()
    await second.aclose()


async def test_a_locked_object_evicted_by_redis_is_a_miss() -> None:
    args = ["--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru"]
    with redis_server(args) as server:
        backend = RedisBackend(RedisOptions(url=server.url))
        first = _key()
        assert await backend.store([first], [_parts(first, 1 << 20)]) == [True]
        assert await backend.lookup_and_lock([first]) == 1
        for _ in range(40):  # far more than fits: Redis evicts, locked or not
            key = _key()
            await backend.store([key], [_parts(key, 1 << 20)])
        assert await backend.load([first], [_buffers(1 << 20)]) == [False]
        assert backend.statistics()["locks"] == 1
        await backend.unlock([first])
        assert backend.statistics()["locks"] == 0
        await backend.aclose()


@pytest.mark.parametrize("stored", [True, False], ids=["stored", "refused"])
async def test_an_unlock_while_a_store_of_the_key_is_answered_deletes_only_the_old_object(
    backend: RedisBackend, standalone: LocalRedis, stored: bool
) -> None:
    """The key's last unlock comes after Redis applied the new SET and before its answer is
    seen (held here in the store's thread). Was: the deferred DEL went out at the unlock and
    deleted the new object."""
    key = _key()
    assert await backend.store([key], [_parts(key, 100)]) == [True]
    assert await backend.lookup_and_lock([key]) == 1
    await backend.delete([key])  # locked: deferred until the unlock
    applied, answer = threading.Event(), threading.Event()
    set_from = backend._client.set_from

    def answered_later(*args: Any) -> list[bool]:
        results = set_from(*args) if stored else [False]
        applied.set()
        answer.wait(10)
        return results

    backend._client.set_from = answered_later  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:

        async def store() -> None:
            assert await backend.store([key], [_parts(key, 100, fill=9)]) == [stored]

        nursery.start_soon(store)
        await trio.to_thread.run_sync(applied.wait, 10)
        await backend.unlock([key])  # the last unlock
        answer.set()
    assert await backend.lookup_and_lock([key]) == int(stored)
    name = b"kvtrio:" + key.hex().encode()
    assert (standalone.command("EXISTS", name) == 1) is stored  # (refused: the old one went)
    assert backend.statistics()["doomed"] == 0


async def test_a_store_redis_refuses_for_memory_is_false_not_an_error() -> None:
    args = ["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]
    with redis_server(args) as server:
        backend = RedisBackend(RedisOptions(url=server.url))
        results = []
        for _ in range(10):
            key = _key()
            results += await backend.store([key], [_parts(key, 1 << 20)])
        assert True in results
        assert False in results
        assert backend.statistics()["store_refused"] == results.count(False)
        await backend.aclose()


async def test_a_batch_mixing_hits_misses_and_wrong_sizes(backend: RedisBackend) -> None:
    keys = [_key() for _ in range(4)]
    await backend.store(keys[:3], [_parts(k, 5000) for k in keys[:3]])
    buffers = [_buffers(5000), _buffers(4999), _buffers(5000), _buffers(5000)]
    assert await backend.load(keys, buffers) == [True, False, True, False]
    assert bytes(buffers[2][1]) == bytes([7]) * 5000
    stats = backend.statistics()
    assert (stats["loads"], stats["load_misses"]) == (4, 2)


async def test_redis_py_reads_replies_when_a_connection_has_no_plain_socket(
    backend: RedisBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_client, "connection_socket", lambda connection: None)
    keys = [_key() for _ in range(3)]
    stored = await backend.store(keys[:2], [_parts(k, 70000, fill=0) for k in keys[:2]])
    assert stored == [True, True]
    buffers = [_buffers(70000), _buffers(100), _buffers(70000)]
    assert await backend.load(keys, buffers) == [True, False, False]
    assert bytes(buffers[0][1]) == bytes(70000)


async def test_cluster_keys_are_spread_and_a_moved_slot_is_followed(
    cluster: LocalRedisCluster,
) -> None:
    backend = RedisBackend(RedisOptions(url=cluster.url, cluster=True))
    keys = [_key() for _ in range(30)]
    assert await backend.store(keys, [_parts(k, 1000) for k in keys]) == [True] * 30
    assert all(node.command("DBSIZE") > 0 for node in cluster.nodes)

    # Move the (empty) slot of a new key to another master behind the backend's back.
    key = _key()
    name = b"kvtrio:" + key.hex().encode()
    slot = cluster.nodes[0].command("CLUSTER", "KEYSLOT", name)
    ids = [node.command("CLUSTER", "MYID").decode() for node in cluster.nodes]
    owner = next(
        index
        for index, node in enumerate(cluster.nodes)
        if node.command("CLUSTER", "COUNTKEYSINSLOT", str(slot)) == 0
        and any(start <= slot <= end for start, end, *_ in _slots(node, ids[index]))
    )
    target = (owner + 1) % len(cluster.nodes)
    for index in (target, owner, *(i for i in range(len(ids)) if i not in (owner, target))):
        cluster.nodes[index].command("CLUSTER", "SETSLOT", str(slot), "NODE", ids[target])

    assert await backend.store([key], [_parts(key, 1000)]) == [True]  # MOVED → followed
    assert cluster.nodes[target].command("EXISTS", name) == 1
    assert backend.statistics()["cluster_redirects"] >= 1
    assert await backend.load([key], [_buffers(1000)]) == [True]
    assert await backend.lookup_and_lock([key, *keys]) == 31
    await backend.unlock([key, *keys])
    await backend.aclose()


def _slots(node: LocalRedis, node_id: str) -> list[tuple[int, int]]:
    """The slot ranges ``node`` says ``node_id`` serves (from CLUSTER SLOTS)."""
    ranges = []
    for start, end, primary, *_ in node.command("CLUSTER", "SLOTS"):
        if primary[2].decode() == node_id:
            ranges.append((start, end))
    return ranges


# --------------------------------------------------------------------------- registration


def test_the_entry_point_finds_the_backend() -> None:
    assert load_backend_class("redis") is RedisBackend
    info = next(info for info in describe_backends() if info.name == "redis")
    assert info.error is None
    assert info.target == "kvtrio_redis:RedisBackend"
    names = [name for name, _, _ in info.options]
    assert names[:6] == ["url", "cluster", "prefix", "ttl", "connections", "timeout"]
    assert all(help_text and "\n" not in help_text for _, _, help_text in info.options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"connections": "x"}, "connections"),
        ({"connections": "0"}, "connections"),
        ({"timeout": "-1"}, "timeout"),
        ({"ttl": "soon"}, "ttl"),
        ({"url": "http://cache:6379"}, "url"),
        ({"cluster": "maybe"}, "cluster"),
        ({"cluster": "true", "url": "unix:///tmp/redis.sock"}, "unix"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_options_are_one_line_config_errors(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        create_backend("redis", {"url": "redis://127.0.0.1:1/0", **options})
    assert "\n" not in str(caught.value)
    assert "redis" in str(caught.value)


def test_options_from_strings() -> None:
    raw = {"url": "redis://h:1/2", "cluster": "no", "ttl": "2.5", "connections": "3"}
    backend = create_backend("redis", raw)
    assert isinstance(backend, RedisBackend)
    assert attrs.asdict(backend.options) == {
        "url": "redis://h:1/2",
        "cluster": False,
        "prefix": "kvtrio:",
        "ttl": 2.5,
        "connections": 3,
        "timeout": 5.0,
    }


# --------------------------------------------------------------------------- the wrong mode


async def test_a_cluster_node_without_cluster_true_is_misconfigured_naming_the_option(
    cluster: LocalRedisCluster,
) -> None:
    """Whichever key comes first (its slot on that node or not), the first call says so."""
    for _ in range(3):  # (a key of the node's own slots would have worked without MOVED)
        backend = RedisBackend(RedisOptions(url=cluster.url, cluster=False))
        try:
            with pytest.raises(BackendMisconfigured, match="set cluster=true"):
                await backend.lookup_and_lock([_key()])
        finally:
            await backend.aclose()


async def test_cluster_true_on_a_standalone_redis_is_misconfigured(standalone: LocalRedis) -> None:
    backend = RedisBackend(RedisOptions(url=standalone.url, cluster=True, timeout=2.0))
    try:
        with pytest.raises(BackendMisconfigured, match="remove cluster=true"):
            await backend.lookup_and_lock([_key()])
    finally:
        await backend.aclose()


def test_a_server_on_a_cluster_node_without_cluster_true_stops_in_one_line(
    cluster: LocalRedisCluster, tmp_path: Path
) -> None:
    """``kvtrio serve`` exits with status 2 and one line naming ``cluster=true``, before it
    serves (not a MovedError warning per call)."""
    argv = [sys.executable, "-m", "kvtrio", "serve", "--endpoint", f"ipc://{tmp_path}/s"]
    argv += ["--l1-size", "64MiB", "--shm-dir", str(tmp_path), "--l2", f"redis:url={cluster.url}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "cluster=true" in last
    assert "Traceback" not in done.stderr
