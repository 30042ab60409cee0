"""Issue 22, item 3 (the tier's part): L1 hits reach the backends' eviction policies, batched.

:class:`Touches` alone in simulated time (``autojump_clock``): when it sends, what, in which
order, its bound; then a server in the test's loop: a lookup's L1 hits reach a backend that
takes touches, and never one that does not.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import pytest
import trio

from kvtrio.config import ServerConfig
from kvtrio.l2 import BackendUnavailable
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import EndSession, Lookup, LookupReply
from kvtrio.server.l2tier._backends import Calls, TierBackend
from kvtrio.server.l2tier._touches import BATCH, INTERVAL, PENDING, Touches

from .._support.l2_tier import HASHES, running, store, written_to_l2
from .._support.waiting import await_condition


class _Touched(MemoryBackend):
    """A memory backend that records its ``touch`` calls (and can fail them)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[bytes]] = []
        self.fail = False

    async def touch(self, keys: Sequence[bytes]) -> None:
        self.calls.append(list(keys))
        if self.fail:
            raise BackendUnavailable("touch failed")
        await super().touch(keys)


class _NoTouches(MemoryBackend):
    accepts_touches = False

    async def touch(self, keys: Sequence[bytes]) -> None:
        raise AssertionError("touch of a backend that does not take touches")


def keys(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in range(start, start + n)]


async def test_touches_wait_for_the_interval_or_a_full_batch(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    backend = _Touched()
    touches = Touches([TierBackend(backend, "t")], Calls())
    nursery.start_soon(touches.run)
    touches.add(keys(3))
    await trio.sleep(INTERVAL / 2)
    assert backend.calls == []  # a few keys wait for the interval ...
    await trio.sleep(INTERVAL)
    assert backend.calls == [keys(3)]  # ... then go in one call
    started = trio.current_time()
    touches.add(keys(BATCH + 10, start=100))
    await trio.sleep(0.001)  # a full batch goes at once, not at the interval
    assert backend.calls[1] == keys(BATCH, start=100)
    assert backend.calls[2] == keys(10, start=100 + BATCH)  # (and what waits with it)
    assert trio.current_time() - started < INTERVAL


async def test_a_key_used_again_is_sent_once_last(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    backend = _Touched()
    tier_backend = TierBackend(backend, "t")
    touches = Touches([tier_backend], Calls())
    nursery.start_soon(touches.run)
    a, b, c = keys(3)
    touches.add([a, b, c])
    touches.add([a])  # used again: the last used now
    await trio.sleep(2 * INTERVAL)
    assert backend.calls == [[b, c, a]]
    assert tier_backend.counters["touches"] == 3


async def test_the_waiting_set_is_bounded_and_drops_are_counted(
    autojump_clock: trio.abc.Clock,
) -> None:
    backend = _Touched()
    tier_backend = TierBackend(backend, "t")
    touches = Touches([tier_backend], Calls())  # (its task is not running: nothing is sent)
    touches.add(keys(PENDING + 5))
    assert touches.waiting == PENDING
    assert touches.dropped == 5
    assert tier_backend.counters["touches_dropped"] == 5
    touches.add(keys(1))  # a key already waiting is not new: it moves, nothing is dropped
    assert touches.dropped == 5


async def test_a_failing_touch_is_a_backend_failure_not_a_crash(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    backend = _Touched()
    backend.fail = True
    tier_backend = TierBackend(backend, "t")
    touches = Touches([tier_backend], Calls())
    nursery.start_soon(touches.run)
    touches.add(keys(2))
    await trio.sleep(1.5 * INTERVAL)  # (sent at INTERVAL)
    assert len(backend.calls) == 1
    assert tier_backend.counters["errors"] == 1
    assert not tier_backend.usable(trio.current_time())  # backed off: what comes meanwhile ...
    tier_backend.down_until = trio.current_time() + 10 * INTERVAL  # (the outage goes on)
    touches.add(keys(2, start=10))
    await trio.sleep(2 * INTERVAL)
    assert len(backend.calls) == 1
    assert tier_backend.counters["touches_dropped"] == 2  # ... is dropped, counted


async def test_a_backend_without_the_capability_is_never_touched(
    autojump_clock: trio.abc.Clock,
) -> None:
    touches = Touches([TierBackend(_NoTouches(), "n")], Calls())
    touches.add(keys(PENDING + 1))
    assert touches.waiting == 0  # nothing to keep: no backend takes them
    with trio.move_on_after(10):
        await touches.run()  # (returns at once)


_SERVERS = itertools.count()


@pytest.fixture
def config(server_config: ServerConfig) -> ServerConfig:
    return attrs.evolve(server_config, lookup_timeout=0.3, retrieve_timeout=2.0)


async def test_the_l1_hits_of_a_lookup_reach_the_backends_policy(config: ServerConfig) -> None:
    backend = _Touched()
    async with running(config, backend) as (_, worker, scheduler):
        await store(worker, "s", 4)
        await written_to_l2(worker, 4)
        for i in range(50):  # served from L1, again and again
            reply = await scheduler.call(Lookup(f"r{i}", "m", 1, HASHES[:4]), LookupReply)
            assert reply.hit_chunks == 4
            await scheduler.request(EndSession(f"r{i}", "m"))
        await await_condition(lambda: backend.calls, what="the touches sent")
        sent = [key for call in backend.calls for key in call]
        assert len(sent) < 50 * 4  # batched: not a call (nor a key) per hit
        assert {key[-16:] for key in sent} == set(HASHES[:4])
        assert [key[-16:] for key in backend.calls[0]] == list(reversed(HASHES[:4]))  # head last
