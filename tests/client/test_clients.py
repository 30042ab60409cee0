"""Both clients: concurrency, timeouts, unreachable servers, restarts, closing."""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time
from collections.abc import Callable

import pytest
import trio

from kvtrio.client import Client, open_client
from kvtrio.errors import (
    ClientClosed,
    ConnectionLost,
    RequestTimeout,
    ServerBusy,
    ServerUnavailable,
    UnknownOperation,
)
from kvtrio.launch import ServerProcess
from kvtrio.protocol import (
    ChunkSize,
    GetChunkSize,
    GetStats,
    Hello,
    HelloReply,
    Ping,
    Pong,
    StatsReply,
)
from kvtrio.server import ServerHandle, Session

from .._support.waiting import await_condition, wait_for

# --------------------------------------------------------------------------- trio client


async def test_async_client_64_concurrent_tasks(server: ServerHandle) -> None:
    tasks, per_task = 64, 200
    done = [0] * tasks
    async with open_client(server.endpoint) as client:

        async def worker(index: int) -> None:
            for _ in range(per_task):
                pong = await client.call(Ping(), Pong)
                assert pong.instance_id == server.instance_id
                done[index] += 1

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for index in range(tasks):
                    nursery.start_soon(worker, index)
    assert done == [per_task] * tasks


async def test_async_client_says_hello_by_itself(server: ServerHandle) -> None:
    async with open_client(server.endpoint, client_name="engine-7") as client:
        with trio.fail_after(5):
            await client.wait_connected()
        assert client.server_info is not None
        assert client.server_info.instance_id == server.instance_id
        (session,) = (await client.call(GetStats(), StatsReply)).sessions
        assert session.client_name == "engine-7"


async def test_async_client_timeout(server: ServerHandle) -> None:
    async def never(session: Session, request: GetChunkSize) -> ChunkSize:
        await trio.sleep_forever()
        raise AssertionError

    server.state.register(GetChunkSize, never)
    async with open_client(server.endpoint) as client:
        await client.wait_connected()
        with pytest.raises(RequestTimeout, match="no reply to 'get_chunk_size'"):
            await client.request(GetChunkSize(), timeout=0.2)


async def test_async_client_without_server(endpoint: str) -> None:
    async with open_client(endpoint) as client:
        with pytest.raises(ServerUnavailable, match="could not reach"):
            await client.request(Ping(), timeout=0.2)


async def test_async_client_error_reply_raises_the_mapped_exception(server: ServerHandle) -> None:
    # (from both tables: an inline operation is answered without the queued path's lookup)
    del server.state.operations[GetChunkSize]
    server.state.inline_operations.pop(GetChunkSize.op, None)
    async with open_client(server.endpoint) as client:
        with pytest.raises(UnknownOperation, match="not served"):
            await client.request(GetChunkSize())


async def test_async_client_closed(server: ServerHandle) -> None:
    async with open_client(server.endpoint) as client:
        pass
    with pytest.raises(ClientClosed):
        await client.request(Ping())


# --------------------------------------------------------------------------- sync client


def test_sync_client_from_many_threads(server_process: Callable[..., ServerProcess]) -> None:
    server = server_process()
    threads, per_thread = 8, 300
    with Client(server.endpoint) as client:

        def worker() -> int:
            ok = 0
            for _ in range(per_thread):
                ok += isinstance(client.request(Ping()), Pong)
            return ok

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(lambda _: worker(), range(threads)))
    assert results == [per_thread] * threads


def test_sync_client_many_in_flight(server_process: Callable[..., ServerProcess]) -> None:
    server = server_process()
    with Client(server.endpoint) as client:
        futures = [client.submit(Ping()) for _ in range(1000)]  # within the session queue
        assert all(isinstance(f.result(timeout=30), Pong) for f in futures)
        # Far beyond the session queue: the excess is refused, every future still settles.
        futures = [client.submit(Ping()) for _ in range(5000)]
        outcomes = [type(f.exception(timeout=30) or f.result()) for f in futures]
        assert set(outcomes) <= {Pong, ServerBusy}
        assert outcomes.count(Pong) >= 1024


def test_sync_client_fails_fast_or_times_out_without_server(endpoint: str) -> None:
    with Client(endpoint, timeout=0.3) as client:
        started = time.monotonic()
        with pytest.raises(ServerUnavailable, match="cannot reach"):
            client.request(Ping())
        assert time.monotonic() - started < 5
        wait_for(lambda: client.state == "disconnected", what="the client to know it is down")
        started = time.monotonic()
        with pytest.raises(ServerUnavailable):
            client.request(Ping(), fail_fast=True, timeout=10)
        assert time.monotonic() - started < 1, "fail_fast must not wait for the timeout"


def test_sync_client_close_fails_pending_requests(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process()
    client = Client(server.endpoint)
    server.stop()  # nothing answers any more
    future = client.submit(Ping(), timeout=30)
    client.close()
    with pytest.raises(ClientClosed):
        future.result(timeout=5)
    with pytest.raises(ClientClosed):
        client.request(Ping())


def test_sync_client_survives_a_server_restart(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process()
    seen: list[HelloReply] = []
    changed = threading.Event()

    def on_server_change(info: HelloReply) -> None:
        seen.append(info)
        changed.set()

    with Client(server.endpoint, timeout=5, on_server_change=on_server_change) as client:
        wait_for(changed.is_set, what="the first hello")
        assert isinstance(client.request(Ping()), Pong)
        changed.clear()

        server.kill()
        wait_for(lambda: client.state == "disconnected", what="the client to notice")
        with pytest.raises(ServerUnavailable):
            client.request(Ping(), fail_fast=True)
        server.start()

        wait_for(changed.is_set, what="the hello to the new server")
        assert len(seen) == 2
        assert seen[0].instance_id != seen[1].instance_id
        assert client.call(Ping(), Pong).instance_id == seen[1].instance_id


def test_sync_client_in_flight_request_fails_when_the_server_dies(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process()
    with Client(server.endpoint, timeout=30) as client:
        wait_for(lambda: client.server_info is not None, what="hello")
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)  # requests are sent but not answered
        try:
            future = client.submit(Hello("x", "1", 1))
            wait_for(lambda: client.in_flight == 1, what="the request to be sent")
        finally:
            server.kill()  # SIGKILL works on a stopped process
        started = time.monotonic()
        with pytest.raises(ConnectionLost):
            future.result(timeout=10)
        assert time.monotonic() - started < 5, "a lost connection must fail promptly"


async def test_async_client_reconnects_after_restart(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = await trio.to_thread.run_sync(server_process)
    async with open_client(server.endpoint, timeout=5) as client:
        await client.wait_connected()
        assert client.server_info is not None
        first = client.server_info.instance_id
        await trio.to_thread.run_sync(server.kill)
        await trio.to_thread.run_sync(server.start)
        await await_condition(
            lambda: client.server_info is not None and client.server_info.instance_id != first,
            what="the hello to the new server",
        )
        assert (await client.call(Ping(), Pong)).instance_id != first
