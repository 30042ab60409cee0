"""The sync client's caller-does-its-own-I/O path: callers receive their own replies; every way
of waiting (blocking, spinning, callbacks) gets exactly its own reply, from many threads."""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import pytest

from kvtrio.client import Client, _state
from kvtrio.errors import RequestTimeout
from kvtrio.launch import ServerProcess
from kvtrio.protocol import Ping, Pong, Probe, ProbeReply, Reply

from .._support.waiting import wait_for
from .raw_server import client_of_raw_server


def test_a_spinning_caller_receives_its_own_reply(
    server_process: Callable[..., ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The old client received every reply in its I/O thread, which a caller holding the GIL
    # in a busy loop starved (6-33 ms per lookup). Now the spinning caller receives it.
    server = server_process()
    settled_in: list[int] = []
    real_settle = _state.settle

    def recording(outcomes: Sequence[_state.Outcome]) -> None:
        settled_in.extend(threading.get_ident() for _ in outcomes)
        real_settle(outcomes)

    monkeypatch.setattr(_state, "settle", recording)
    with Client(server.endpoint, heartbeat=False) as client:
        wait_for(lambda: client.server_info is not None, what="hello")
        for _ in range(20):
            settled_in.clear()
            future = client.submit(Ping())
            deadline = time.monotonic() + 10
            while not future.done():  # holds the GIL but for the switch interval
                client.poll()
                assert time.monotonic() < deadline
            assert isinstance(future.result(), Pong)
            assert settled_in == [threading.get_ident()]


def test_every_way_of_waiting_gets_its_own_reply(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process()
    with Client(server.endpoint) as client:

        def probe(n: int) -> Probe:
            return Probe(tokens=tuple(range(n)), block_ids=tuple(range(n % 7)))

        def blocking(seed: int) -> int:
            ok = 0
            for i in range(150):
                n = seed * 1000 + i
                reply = client.request(probe(n))
                ok += reply == ProbeReply(n, n % 7)
            return ok

        def spinning(seed: int) -> int:
            ok = 0
            for i in range(150):
                n = seed * 1000 + i
                future = client.submit(probe(n))
                while not future.done():
                    client.poll()
                ok += future.result() == ProbeReply(n, n % 7)
            return ok

        def callbacks(seed: int) -> int:
            done = threading.Semaphore(0)
            ok: list[bool] = []

            def check(n: int) -> Callable[[Future[Reply]], None]:
                def on_done(future: Future[Reply]) -> None:
                    ok.append(future.result() == ProbeReply(n, n % 7))
                    done.release()

                return on_done

            for i in range(150):
                n = seed * 1000 + i
                client.submit(probe(n)).add_done_callback(check(n))
            for _ in range(150):
                assert done.acquire(timeout=30)
            return sum(ok)

        kinds = [blocking, spinning, callbacks] * 3
        with concurrent.futures.ThreadPoolExecutor(len(kinds)) as pool:
            results = list(pool.map(lambda k: k[1](k[0] + 1), enumerate(kinds)))
    assert results == [150] * len(kinds)


def test_a_blocked_caller_times_out_at_its_deadline(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process()
    with Client(server.endpoint, heartbeat=False) as client:
        wait_for(lambda: client.server_info is not None, what="hello")
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)  # connected, never answering
        try:
            start = time.monotonic()
            with pytest.raises(RequestTimeout):
                client.request(Ping(), timeout=0.3)
            assert time.monotonic() - start < 5
        finally:
            server.proc.send_signal(signal.SIGCONT)


def test_a_waiting_caller_takes_over_when_the_receiving_one_leaves(endpoint: str) -> None:
    # Two threads wait for replies; the one receiving (sleeping on the socket) gets its reply
    # first and returns. The other's reply, coming later, must reach it at once, not when the
    # background thread next wakes up (up to a second) or at its deadline.
    with (
        client_of_raw_server(endpoint) as (client, server),
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        first = pool.submit(client.request, Ping())
        first_request = server.take()
        wait_for(lambda: client._shared.leader is not None, what="a caller on the socket")
        second = pool.submit(client.request, Ping())
        second_request = server.take()
        wait_for(lambda: client._shared.followers == 1, what="the second caller to wait")
        server.answer(first_request, Pong("raw"))
        assert isinstance(first.result(timeout=5), Pong)
        start = time.monotonic()
        server.answer(second_request, Pong("raw"))
        assert isinstance(second.result(timeout=5), Pong)
        assert time.monotonic() - start < 0.5


def test_result_with_a_timeout_waits_that_long_once(endpoint: str) -> None:
    # Was: the caller received until ``timeout`` passed, then Future.result waited ``timeout``
    # again, without receiving (TimeoutError after 2.0 s for 1.0 s).
    with client_of_raw_server(endpoint) as (client, server):
        future = client.submit(Ping(), timeout=30)
        taken = server.take()
        for wait in (future.result, future.exception):
            start = time.monotonic()
            with pytest.raises(concurrent.futures.TimeoutError):
                wait(1.0)
            assert 0.99 <= time.monotonic() - start < 1.8
        server.answer(taken, Pong("raw"))  # the request stayed pending
        assert isinstance(future.result(timeout=5), Pong)
