"""The trio⇄ZeroMQ adapter: no lost wakeups, no lost messages, clean close and cancellation."""

from __future__ import annotations

import select
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio
import trio.testing
import zmq

from kvtrio.transport import Socket, ensure_endpoint_free, open_socket
from kvtrio.transport._endpoints import is_listening
from kvtrio.transport._zmq import Socket as AdapterSocket


class NaiveSocket(AdapterSocket):
    """The adapter without rule 3: it does not re-check ZMQ_EVENTS after its own calls.

    This is how naive trio/asyncio adapters are written; it loses wakeups.
    """

    def _after_call(self) -> None:
        pass


@pytest.fixture
def raw_router(endpoint: str) -> AsyncIterator[zmq.Socket[bytes]]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    yield sock  # type: ignore[misc]
    sock.close(linger=0)


async def _recv_as_edge_owner(socket: Socket) -> list[bytes]:
    """Serve ``socket``'s edge until one message came; return it."""
    got: list[list[bytes]] = []
    with trio.CancelScope() as scope:

        def drain() -> bool:
            while (frames := socket.try_recv_multipart()) is not None:
                got.append(frames)
                scope.cancel()
            return False

        await socket.serve_edge(drain)
    return got[0]


async def _lost_wakeup_scenario(
    dealer: Socket, router: zmq.Socket[bytes], *, edge_owner: bool = False
) -> bytes | None:
    """Reproduce the lost wakeup; return what the parked reader got (None if it never woke).

    1. a reader task parks in recv (no message yet);
    2. a message arrives: ZMQ_FD becomes readable — we wait for that with select(), without any
       libzmq call and without letting trio run the pump;
    3. before the pump runs, another task sends: libzmq processes its command queue during the
       send, which consumes the FD's readability (the edge) although the message is queued;
    4. the pump now waits for an edge that will never come.

    libzmq processes commands in send() at most once per ``max_command_delay`` (3M TSC ticks,
    about 1 ms), so step 3 only consumes the edge if that long has passed since the last send:
    the scenario blocks the whole event loop for 10 ms first, which also keeps the pump from
    running. In a server this happens whenever a reply goes out after a quiet millisecond.
    """
    assert dealer.try_send_multipart([b"who am i"])
    assert router.poll(5000)
    identity, _ = router.recv_multipart()
    got: list[bytes] = []
    woke = trio.Event()

    async def reader() -> None:
        if edge_owner:
            got.extend(await _recv_as_edge_owner(dealer))
        else:
            got.extend(await dealer.recv_multipart())
        woke.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()  # the reader is parked
        router.send_multipart([identity, b"the reply"])
        readable, _, _ = select.select([dealer._fd], [], [], 5.0)
        assert readable, "the message never reached the dealer"
        # Block the loop on purpose: let libzmq's send-side command throttle window pass.
        time.sleep(0.01)  # noqa: ASYNC251
        assert dealer.try_send_multipart([b"unrelated send"])  # consumes the edge
        with trio.move_on_after(1.0):
            await woke.wait()
        nursery.cancel_scope.cancel()
    return got[0] if got else None


async def test_lost_wakeup_is_reproduced_with_a_naive_adapter(
    raw_router: zmq.Socket[bytes], endpoint: str
) -> None:
    zsock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    zsock.setsockopt(zmq.LINGER, 0)
    naive = NaiveSocket(zsock)
    async with trio.open_nursery() as nursery:
        await nursery.start(naive._pump)
        naive.connect(endpoint)
        assert await _lost_wakeup_scenario(naive, raw_router) is None
        naive.close()


async def test_adapter_survives_the_lost_wakeup_scenario(
    raw_router: zmq.Socket[bytes], endpoint: str
) -> None:
    async with open_socket(zmq.DEALER) as dealer:
        dealer.connect(endpoint)
        assert await _lost_wakeup_scenario(dealer, raw_router) == b"the reply"


async def test_an_edge_owning_reader_survives_the_lost_wakeup_scenario(
    raw_router: zmq.Socket[bytes], endpoint: str
) -> None:
    # The server's router reads this way: no pump, the reader waits on the FD itself.
    async with open_socket(zmq.DEALER, pump=False) as dealer:
        dealer.connect(endpoint)
        assert await _lost_wakeup_scenario(dealer, raw_router, edge_owner=True) == b"the reply"


async def test_an_edge_owning_reader_is_woken_by_close(endpoint: str) -> None:
    async with open_socket(zmq.DEALER, pump=False) as dealer:
        dealer.connect(endpoint)
        with pytest.raises(RuntimeError):
            await dealer.recv_multipart()  # no pump: only serve_edge() may wait
        raised: list[BaseException] = []

        async def reader() -> None:
            try:
                await _recv_as_edge_owner(dealer)
            except trio.ClosedResourceError as exc:
                raised.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            dealer.close()
        assert len(raised) == 1


async def test_an_edge_owner_survives_the_lost_wakeup_again_and_again(
    raw_router: zmq.Socket[bytes], endpoint: str
) -> None:
    # serve_edge keeps one cancel scope for many waits and makes a new one after rule 3
    # cancelled it: every round of the scenario must wake the same serving task.
    async with open_socket(zmq.DEALER, pump=False) as dealer:
        dealer.connect(endpoint)
        assert dealer.try_send_multipart([b"who am i"])
        assert raw_router.poll(5000)
        identity, _ = raw_router.recv_multipart()
        got: list[list[bytes]] = []
        arrived = trio.Event()

        def drain() -> bool:
            while (frames := dealer.try_recv_multipart()) is not None:
                got.append(frames)
                arrived.set()
            return False

        async with trio.open_nursery() as nursery:
            nursery.start_soon(dealer.serve_edge, drain)
            for round_ in range(3):
                await trio.testing.wait_all_tasks_blocked()  # the owner waits on the FD
                arrived = trio.Event()
                raw_router.send_multipart([identity, b"reply %d" % round_])
                readable, _, _ = select.select([dealer._fd], [], [], 5.0)
                assert readable, "the message never reached the dealer"
                time.sleep(0.01)  # noqa: ASYNC251 - let libzmq's send throttle window pass
                assert dealer.try_send_multipart([b"unrelated send"])  # consumes the edge
                with trio.fail_after(1.0):
                    await arrived.wait()
                assert got[-1] == [b"reply %d" % round_]
            with pytest.raises(trio.BusyResourceError):
                await dealer.serve_edge(drain)  # one edge owner at a time
            nursery.cancel_scope.cancel()


@pytest.fixture
def echo_server(endpoint: str) -> Iterator[str]:
    """The adapter-based echo server of ``echo_server.py`` in its own process (its own core)."""
    script = Path(__file__).with_name("echo_server.py")
    proc = subprocess.Popen(
        [sys.executable, str(script), endpoint], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield endpoint
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.mark.slow
async def test_64_concurrent_requesters_lose_no_reply(echo_server: str) -> None:
    """64 requester tasks × 10k requests each, a few in flight per requester, every reply
    accounted for; the echo server answers from other tasks than the one receiving."""
    requesters, per_requester, window = 64, 10_000, 8
    received = [0] * requesters

    async def requester(index: int) -> None:
        async with open_socket(zmq.DEALER) as dealer:
            dealer.connect(echo_server)
            for start in range(0, per_requester, window):
                batch = range(start, min(start + window, per_requester))
                for seq in batch:
                    await dealer.send_multipart([seq.to_bytes(4, "little")])
                for seq in batch:
                    (payload,) = await dealer.recv_multipart()
                    assert int.from_bytes(payload, "little") == seq
                    received[index] += 1

    with trio.fail_after(300):
        async with trio.open_nursery() as clients:
            for index in range(requesters):
                clients.start_soon(requester, index)
    assert received == [per_requester] * requesters


async def test_close_wakes_parked_tasks(endpoint: str) -> None:
    async with open_socket(zmq.DEALER) as dealer:
        dealer.connect(endpoint)
        with pytest.RaisesGroup(trio.ClosedResourceError):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dealer.recv_multipart)
                await trio.testing.wait_all_tasks_blocked()
                dealer.close()
        assert dealer.closed
        with pytest.raises(trio.ClosedResourceError):
            dealer.try_send_multipart([b"x"])


async def test_cancelled_receive_takes_no_message(endpoint: str) -> None:
    async with open_socket(zmq.ROUTER) as router, open_socket(zmq.DEALER) as dealer:
        router.bind(endpoint)
        dealer.connect(endpoint)
        with trio.move_on_after(0.05):
            await router.recv_multipart()
        await dealer.send_multipart([b"after"])
        with trio.fail_after(5):
            _, payload = await router.recv_multipart()
        assert payload == b"after"


@pytest.mark.parametrize("pump", [True, False])
async def test_send_waits_at_the_high_water_mark(endpoint: str, pump: bool) -> None:
    """A DEALER with IMMEDIATE and no peer cannot send; the send parks, then completes (woken
    by the pump, or by the task serving the edge of a socket without pump)."""
    options = {zmq.IMMEDIATE: 1, zmq.SNDHWM: 1}
    async with open_socket(zmq.DEALER, options=options, pump=pump) as dealer:
        dealer.connect(endpoint)
        assert not dealer.try_send_multipart([b"nobody there"])
        async with trio.open_nursery() as nursery:
            if not pump:
                nursery.start_soon(
                    dealer.serve_edge, lambda: dealer.try_recv_multipart() is not None
                )
            nursery.start_soon(dealer.send_multipart, [b"queued"])
            await trio.testing.wait_all_tasks_blocked()
            async with open_socket(zmq.ROUTER) as router:
                router.bind(endpoint)
                with trio.fail_after(5):
                    _, payload = await router.recv_multipart()
                assert payload == b"queued"
            nursery.cancel_scope.cancel()


def test_bind_reports_the_real_port() -> None:
    async def main() -> str:
        async with open_socket(zmq.ROUTER) as router:
            return router.bind("tcp://127.0.0.1:0")

    bound = trio.run(main)
    assert bound.startswith("tcp://127.0.0.1:")
    assert not bound.endswith(":0")


async def test_leaving_open_socket_releases_its_ipc_endpoint(endpoint: str) -> None:
    """libzmq closes listeners in its I/O thread: when the block is left, nothing listens on
    the path any more, so a server restarted in the same process may bind it again."""
    assert endpoint.startswith("ipc://")
    path = endpoint[len("ipc://") :]
    for _ in range(20):
        async with (
            open_socket(zmq.ROUTER, linger=1000) as router,
            open_socket(zmq.DEALER) as dealer,
        ):
            router.bind(endpoint)
            assert is_listening(path)
            dealer.connect(endpoint)
            await dealer.send_multipart([b"hello"])
            identity, _ = await router.recv_multipart()
            await router.send_multipart([identity, b"bye"])
            await dealer.recv_multipart()
        assert not is_listening(path)
        ensure_endpoint_free(endpoint)
