"""What the conformance suite does not cover: outages, buckets, options, registration, layout."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import obstore
import pytest
import trio
import trio.testing
from kvtrio_s3 import S3Backend, S3Options
from obstore.store import S3Store

from conftest import BUCKET, options_for
from kvtrio.errors import ConfigError
from kvtrio.l2 import (
    HEADER_SIZE,
    BackendError,
    BackendUnavailable,
    create_backend,
    describe_backends,
    header,
)
from tests._support.seaweedfs import SeaweedFS, seaweedfs

FINGERPRINT = b"s3-tests-fp-16by"


def _key() -> bytes:
    return os.urandom(32)


def _object(key: bytes, size: int = 100_000) -> list[memoryview]:
    payload = bytearray(os.urandom(size))
    return [memoryview(header(key, FINGERPRINT, payload)), memoryview(payload)]


def _buffers(size: int = 100_000) -> list[memoryview]:
    return [memoryview(bytearray(HEADER_SIZE)), memoryview(bytearray(size))]


def _raw_store(server: SeaweedFS, bucket: str = BUCKET) -> S3Store:
    return S3Store(
        bucket,
        endpoint=server.endpoint,
        region=server.region,
        access_key_id=server.access_key_id,
        secret_access_key=server.secret_access_key,
        client_options={"allow_http": True},
    )


async def _all_operations_fail(backend: S3Backend, error: type[BackendError]) -> None:
    key = _key()
    with pytest.raises(error):
        await backend.lookup_and_lock([key])
    with pytest.raises(error):
        await backend.store([key], [_object(key)])
    with pytest.raises(error):
        await backend.load([key], [_buffers()])
    with pytest.raises(error):
        await backend.delete([key])
    assert backend.statistics()["locks"] == 0


async def _round_trip(backend: S3Backend) -> None:
    key = _key()
    parts = _object(key)
    assert await backend.store([key], [parts]) == [True]
    assert await backend.lookup_and_lock([key]) == 1
    buffers = _buffers()
    assert await backend.load([key], [buffers]) == [True]
    assert [bytes(b) for b in buffers] == [bytes(p) for p in parts]
    await backend.unlock([key])


async def _round_trip_once_back(backend: S3Backend, within: float = 30.0) -> None:
    """A round trip as soon as the restarted service answers (it may take a few of the
    backend's 2 s timeouts on a loaded machine); fails if it never does within ``within``."""
    deadline = trio.current_time() + within
    while True:
        try:
            await _round_trip(backend)
            return
        except BackendUnavailable:
            if trio.current_time() > deadline:
                raise
            await trio.sleep(0.2)  # (a retry pause, not a wait for a condition)


# --------------------------------------------------------------------------- outages


@pytest.fixture
def refusing_endpoint() -> Iterator[str]:
    """An http URL on a loopback port that is bound but not listening: connections refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An http URL whose server accepts connections (backlog) but never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_a_backend_whose_service_is_down_constructs_and_fails_promptly(
    s3_server: SeaweedFS, refusing_endpoint: str
) -> None:
    backend = S3Backend(options_for(s3_server, endpoint=refusing_endpoint, timeout=2.0))
    with trio.fail_after(2 * 4 * 2.0):  # four operations, each bounded by about the timeout
        await _all_operations_fail(backend, BackendUnavailable)
    assert backend.statistics()["unavailable"] >= 4
    await backend.aclose()


async def test_a_service_that_never_answers_times_out(
    s3_server: SeaweedFS, silent_endpoint: str
) -> None:
    backend = S3Backend(options_for(s3_server, endpoint=silent_endpoint, timeout=0.5))
    start = trio.current_time()
    with pytest.raises(BackendUnavailable, match="no answer"):
        await backend.lookup_and_lock([_key()])
    assert trio.current_time() - start < 3.0
    await backend.aclose()


async def test_recovers_by_itself_when_the_service_comes_back() -> None:
    with seaweedfs() as server:
        await trio.to_thread.run_sync(server.stop)
        backend = S3Backend(options_for(server, timeout=2.0))  # constructed while down
        await _all_operations_fail(backend, BackendUnavailable)

        await trio.to_thread.run_sync(server.start)
        await _round_trip_once_back(backend)
        kept = _key()
        assert await backend.store([kept], [_object(kept)]) == [True]

        await trio.to_thread.run_sync(server.stop)  # down again, after it was in use
        await _all_operations_fail(backend, BackendUnavailable)

        await trio.to_thread.run_sync(server.start)
        await _round_trip_once_back(backend)
        assert await backend.lookup_and_lock([kept]) == 1  # what was stored survived
        await backend.unlock([kept])
        await backend.aclose()


# --------------------------------------------------------------------------- buckets


async def test_create_bucket(s3_server: SeaweedFS) -> None:
    bucket = f"kvtrio-new-{uuid.uuid4().hex[:8]}"
    backend = S3Backend(options_for(s3_server, bucket=bucket, create_bucket=True))
    await _round_trip(backend)
    await backend.aclose()
    again = S3Backend(options_for(s3_server, bucket=bucket, create_bucket=False))
    await _round_trip(again)  # it exists now
    await again.aclose()


async def test_a_missing_bucket_is_a_clear_error(s3_server: SeaweedFS) -> None:
    bucket = f"kvtrio-missing-{uuid.uuid4().hex[:8]}"
    backend = S3Backend(options_for(s3_server, bucket=bucket, create_bucket=False))
    await _all_operations_fail(backend, BackendError)
    with pytest.raises(BackendError) as caught:
        await backend.lookup_and_lock([_key()])
    assert not isinstance(caught.value, BackendUnavailable)
    message = str(caught.value)
    assert bucket in message
    assert "does not exist" in message
    assert "create_bucket" in message
    assert "\n" not in message
    await backend.aclose()


async def test_wrong_credentials_are_a_clear_error(s3_server: SeaweedFS) -> None:
    backend = S3Backend(options_for(s3_server, secret_access_key="not-the-secret"))
    with pytest.raises(BackendError, match="denied"):
        await backend.lookup_and_lock([_key()])
    await backend.aclose()


# --------------------------------------------------------------------------- options


def test_options_are_validated_in_one_line() -> None:
    cases = {
        "bucket: required field missing": {},
        "bucket": {"bucket": " "},
        "connections": {"bucket": "b", "connections": "0"},
        "allow_http": {"bucket": "b", "endpoint": "http://127.0.0.1:1"},
        "endpoint": {"bucket": "b", "endpoint": "s3.example"},
        "timeout": {"bucket": "b", "timeout": "soon"},
        "secret_access_key": {"bucket": "b", "access_key_id": "AKIA"},
        "unknown option": {"bucket": "b", "buckets": "x"},
    }
    for expected, options in cases.items():
        with pytest.raises(ConfigError) as caught:
            create_backend("s3", options)
        message = str(caught.value)
        assert expected in message, message
        assert "'s3'" in message
        assert "\n" not in message


def test_create_backend_from_strings_does_not_connect() -> None:
    backend = create_backend(
        "s3",
        {
            "bucket": "b",
            "endpoint": "http://127.0.0.1:1",
            "allow_http": "true",
            "connections": "4",
            "timeout": "1.5",
            "create_bucket": "yes",
        },
    )
    assert isinstance(backend, S3Backend)
    assert backend.options == S3Options(
        bucket="b",
        endpoint="http://127.0.0.1:1",
        allow_http=True,
        connections=4,
        timeout=1.5,
        create_bucket=True,
    )
    assert backend.statistics()["ready"] == 0
    assert "secret" not in repr(S3Options(bucket="b", access_key_id="a", secret_access_key="s"))


def test_describe_backends_lists_s3_with_its_options() -> None:
    (info,) = [info for info in describe_backends() if info.name == "s3"]
    assert info.error is None
    assert info.target == "kvtrio_s3:S3Backend"
    names = [name for name, _, _ in info.options]
    assert names[:3] == ["bucket", "endpoint", "region"]
    assert {"prefix", "access_key_id", "secret_access_key", "allow_http"} <= set(names)
    assert {"connections", "create_bucket", "timeout"} <= set(names)
    assert all(help_text and "\n" not in help_text for _, _, help_text in info.options)


# --------------------------------------------------------------------------- semantics


async def test_one_object_per_key_under_the_prefix(s3_server: SeaweedFS) -> None:
    options = options_for(s3_server)
    backend = S3Backend(options)
    key = _key()
    parts = _object(key)
    assert await backend.store([key], [parts]) == [True]
    name = f"{options.prefix}{key.hex()[:2]}/{key.hex()}"
    result = await trio.to_thread.run_sync(obstore.get, _raw_store(s3_server), name)
    raw = bytes(await trio.to_thread.run_sync(result.bytes))
    assert raw == b"".join(parts)  # header and chunk, one object
    await backend.aclose()


async def test_an_object_deleted_behind_our_back_is_a_miss(s3_server: SeaweedFS) -> None:
    options = options_for(s3_server)
    backend = S3Backend(options)
    key = _key()
    await backend.store([key], [_object(key)])
    assert await backend.lookup_and_lock([key]) == 1
    name = f"{options.prefix}{key.hex()[:2]}/{key.hex()}"
    await trio.to_thread.run_sync(obstore.delete, _raw_store(s3_server), name)  # a lifecycle rule
    assert await backend.load([key], [_buffers()]) == [False]
    assert backend.statistics()["load_misses"] == 1
    await backend.unlock([key])
    assert backend.statistics()["locks"] == 0
    await backend.aclose()


async def test_lookup_stops_at_the_first_miss(s3_server: SeaweedFS) -> None:
    backend = S3Backend(options_for(s3_server, connections=1))  # one HEAD at a time, in order
    keys = [_key() for _ in range(12)]
    for key in (keys[0], *keys[2:]):
        await backend.store([key], [_object(key, 1000)])
    assert await backend.lookup_and_lock(keys) == 1
    assert backend.statistics()["heads"] == 2  # keys after the miss were not asked for
    await backend.unlock(keys[:1])
    await backend.aclose()


async def test_a_cancelled_store_leaves_nothing_behind(s3_server: SeaweedFS) -> None:
    options = options_for(s3_server, connections=1)
    backend = S3Backend(options)
    await backend.lookup_and_lock([_key()])  # checks the bucket first
    keys = [_key(), _key()]
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def store() -> None:
            with scope:
                await backend.store(keys, [_object(key, 4 << 20) for key in keys])

        nursery.start_soon(store)
        await trio.testing.wait_all_tasks_blocked()  # one PUT in its thread, one waiting
        assert backend.statistics()["connections_busy"] == 1
        scope.cancel()
    assert scope.cancelled_caught
    stats = backend.statistics()
    assert (stats["stores"], stats["deletes"]) == (1, 1)  # one written, then deleted again
    assert await backend.lookup_and_lock(keys[:1]) == 0
    assert await backend.lookup_and_lock(keys[1:]) == 0
    await backend.aclose()


async def test_a_store_replaces_a_pending_delete(s3_server: SeaweedFS) -> None:
    backend = S3Backend(options_for(s3_server))
    key = _key()
    await backend.store([key], [_object(key)])
    assert await backend.lookup_and_lock([key]) == 1
    await backend.delete([key])  # deferred: locked
    assert await backend.lookup_and_lock([key]) == 0  # already invisible to lookups
    assert backend.statistics()["pending_deletes"] == 1
    await backend.store([key], [_object(key)])  # a new object under the key
    await backend.unlock([key])
    assert await backend.lookup_and_lock([key]) == 1  # the new object was not deleted
    await backend.unlock([key])
    await backend.aclose()


@pytest.mark.parametrize("stored", [True, False], ids=["stored", "failed"])
async def test_an_unlock_while_a_store_of_the_key_is_answered_deletes_only_the_old_object(
    s3_server: SeaweedFS, stored: bool
) -> None:
    """The key's last unlock comes after the service applied the new PUT and before its
    answer is seen (held here in the store's thread). Was: the deferred DELETE went out at the
    unlock and deleted the new object."""
    backend = S3Backend(options_for(s3_server))
    key = _key()
    await backend.store([key], [_object(key)])
    assert await backend.lookup_and_lock([key]) == 1
    await backend.delete([key])  # deferred: locked
    applied, answer = threading.Event(), threading.Event()
    put = backend._client.put

    def answered_later(path: str, parts: Any) -> None:
        if stored:
            put(path, parts)
        applied.set()
        answer.wait(10)
        if not stored:
            raise BackendUnavailable("s3: the PUT failed")

    backend._client.put = answered_later  # type: ignore[method-assign]

    async def store() -> None:
        if stored:
            assert await backend.store([key], [_object(key)]) == [True]
        else:
            with pytest.raises(BackendUnavailable):
                await backend.store([key], [_object(key)])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(store)
        await trio.to_thread.run_sync(applied.wait, 10)
        await backend.unlock([key])  # the last unlock
        answer.set()
    backend._client.put = put  # type: ignore[method-assign]
    assert await backend.lookup_and_lock([key]) == int(stored)
    assert backend.statistics()["pending_deletes"] == 0
    await backend.aclose()


async def test_closed_backend_refuses_operations(s3_server: SeaweedFS) -> None:
    backend = S3Backend(options_for(s3_server))
    await _round_trip(backend)
    await backend.aclose()
    await backend.aclose()  # idempotent
    await _all_operations_fail(backend, BackendError)


async def test_statistics_count_operations(s3_server: SeaweedFS) -> None:
    backend = S3Backend(options_for(s3_server))
    await _round_trip(backend)
    stats = backend.statistics()
    expected = {"stores": 1, "loads": 1, "lookups": 1, "errors": 0, "locks": 0, "ready": 1}
    assert {name: stats[name] for name in expected} == expected
    assert stats["store_bytes"] == stats["load_bytes"] == HEADER_SIZE + 100_000
    await backend.aclose()
