"""The one boundary for calls into L2 backends (``Calls.call``) and the optional capabilities.

The tier's tests exercise it through a server; these pin its contract alone: what a failure, a
success, a partial answer and a cancellation do to the backend's health and to the metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import trio

from kvtrio.l2 import BackendUnavailable, Buffers, Capabilities, capabilities
from kvtrio.l2.disk import DiskBackend
from kvtrio.l2.memory import MemoryBackend
from kvtrio.server.l2tier._backends import Calls, TierBackend
from kvtrio.testing import FaultBackend

Observed = list[tuple[str, str, bool]]


def calls_and_log() -> tuple[Calls, Observed]:
    seen: Observed = []
    return Calls(lambda label, op, seconds, ok: seen.append((label, op, ok))), seen


async def test_a_failure_is_the_backends_and_goes_no_further() -> None:
    calls, seen = calls_and_log()
    backend = TierBackend(MemoryBackend(), "memory", "memory")
    with calls.call(backend, "store", "store") as call:
        await trio.lowlevel.checkpoint()
        raise BackendUnavailable("gone")
    assert call.failed
    assert seen == [("memory", "store", False)]
    assert backend.problems == {"store": "gone"}
    assert backend.counters == {"errors": 1}
    assert not backend.usable(trio.current_time())
    assert backend.healthy is False


async def test_a_success_heals_its_role_only_when_it_proves_it() -> None:
    calls, seen = calls_and_log()
    backend = TierBackend(MemoryBackend(), "memory", "memory")
    backend.failed(BackendUnavailable("gone"), trio.current_time(), "store")
    with calls.call(backend, "delete", "store") as call:  # (a delete proves nothing here)
        await trio.lowlevel.checkpoint()
    assert not call.failed
    assert backend.problems == {"store": "gone"}
    with calls.call(backend, "store", "store", heals=True):
        await trio.lowlevel.checkpoint()
    assert (backend.problems, backend.healthy) == ({}, True)
    assert backend.usable(trio.current_time())
    assert seen == [("memory", "delete", True), ("memory", "store", True)]


async def test_a_partial_answer_is_observed_as_not_succeeded_but_is_no_failure() -> None:
    calls, seen = calls_and_log()
    backend = TierBackend(MemoryBackend(), "memory", "memory")
    with calls.call(backend, "load") as call:
        call.complete = False
    assert not call.failed
    assert seen == [("memory", "load", False)]
    assert (backend.problems, backend.counters) == ({}, {})


async def test_probes_are_not_metered() -> None:
    calls, seen = calls_and_log()
    backend = TierBackend(MemoryBackend(), "memory", "memory")
    with calls.call(backend, "lookup_and_lock", heals=True, metered=False):
        pass
    with calls.call(backend, "lookup_and_lock", metered=False):
        raise OSError("no")
    assert seen == []
    assert backend.counters == {"errors": 1}


async def test_cancellation_passes_through_unobserved() -> None:
    calls, seen = calls_and_log()
    backend = TierBackend(MemoryBackend(), "memory", "memory")
    with trio.CancelScope() as scope:
        with calls.call(backend, "load"):
            scope.cancel()
            await trio.sleep_forever()
        pytest.fail("the cancellation was swallowed")
    assert scope.cancelled_caught
    assert (seen, backend.problems, backend.counters, backend.known) == ([], {}, {}, False)


class _Recording(MemoryBackend):
    """Takes parents and owners as its flags say; records what ``store`` was given."""

    def __init__(self, **flags: bool) -> None:
        super().__init__()
        for name, value in flags.items():
            setattr(self, name, value)
        self.given: list[dict[str, Any]] = []

    async def store(
        self, keys: Sequence[bytes], buffers: Sequence[Buffers], **extra: Any
    ) -> list[bool]:
        self.given.append(extra)
        return await super().store(keys, buffers)


@pytest.mark.parametrize(
    ("flags", "given"),
    [
        ({}, {}),
        ({"accepts_parents": True}, {"parents": [None]}),
        ({"accepts_owners": True}, {"owners": [b"o" * 16]}),
        (
            {"accepts_parents": True, "accepts_owners": True},
            {"parents": [None], "owners": [b"o" * 16]},
        ),
        ({"accepts_parents": False, "accepts_owners": False}, {}),
        ({"accepts_names": True}, {"names": [b"n"]}),
    ],
)
async def test_store_gives_a_backend_what_its_capabilities_say(
    flags: dict[str, bool], given: dict[str, Any]
) -> None:
    backend = _Recording(**flags)
    tier_backend = TierBackend(backend, "memory")
    key, parts = b"k" * 32, [memoryview(b"object")]
    stored = await tier_backend.store(
        [key], [parts], parents=[None], owners=[b"o" * 16], names=[b"n"]
    )
    assert stored == [True]
    await tier_backend.store([key], [parts])  # (nothing given: nothing passed)
    assert backend.given == [given, {}]


def test_capabilities_are_read_from_the_class_flags() -> None:
    assert capabilities(DiskBackend()) == Capabilities(
        parents=True, owners=True, touches=True, names=True
    )
    assert capabilities(MemoryBackend()) == Capabilities(touches=True)
    assert capabilities(FaultBackend(inner=MemoryBackend())) == Capabilities()
    assert TierBackend(MemoryBackend(), "memory").capabilities.touches
