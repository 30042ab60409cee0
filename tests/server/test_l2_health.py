"""Issue 22 item 8: an L2 backend's health is the truth.

A backend that cannot store is unhealthy, with the reason, from its first failed store on, also
once its backoff has passed, until a store works again (the probe retries it, no traffic needed);
lookups that answer do not make it healthy.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence

import attrs
import pytest
import trio

from kvtrio.config import ServerConfig
from kvtrio.l2 import Buffers
from kvtrio.l2.memory import MemoryBackend
from kvtrio.server import status_document, status_summary

from .._support.l2_tier import running, stats, store
from .._support.waiting import await_async, await_condition


@pytest.fixture
def config(server_config: ServerConfig) -> ServerConfig:
    return attrs.evolve(server_config, lookup_timeout=2.0, retrieve_timeout=2.0)


class _ReadOnly(MemoryBackend):
    """Answers lookups; every store fails as on a read-only filesystem while ``broken``."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = True

    async def store(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        if self.broken:
            raise OSError(errno.EROFS, "Read-only file system")
        return await super().store(keys, buffers)


async def test_a_backend_that_cannot_store_is_unhealthy_with_the_reason_until_a_store_works(
    config: ServerConfig,
) -> None:
    """Was: healthy, because the start-up probe only looked up, and again healthy as soon as
    the backoff after a failed store had passed (``"healthy": true`` next to ``"errors": 3``)."""
    backend = _ReadOnly()
    async with running(config, backend) as (server, worker, _):
        tier = server.state.cache.io.l2.backends[0]  # type: ignore[union-attr]

        async def health_is(value: bool) -> bool:
            return (await stats(worker)).l2[0].healthy is value

        await await_async(lambda: health_is(True), what="the probe's lookup to answer")
        await store(worker, "a", 3)  # write-behind tries, fails, backs off
        await await_condition(lambda: tier.counters.get("errors", 0) >= 1, what="a failed store")
        await await_condition(lambda: tier.usable(trio.current_time()), what="the backoff to pass")
        reply = await stats(worker)
        assert reply.l2[0].healthy is False
        assert reply.l2[0].problem == "stores fail: OSError: Read-only file system"
        document = status_document(reply)
        assert document["l2"][0]["healthy"] is False
        assert document["l2"][0]["problem"] == "stores fail: OSError: Read-only file system"
        summary = status_summary(document).splitlines()
        assert summary[-1] == "l2: UNHEALTHY (stores fail: OSError: Read-only file system)"

        backend.broken = False  # mended: the next probe (no traffic needed) finds it working
        await await_async(lambda: health_is(True), timeout=40, what="healthy again")
        assert (await stats(worker)).l2[0].problem == ""
