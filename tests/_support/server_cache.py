"""What a test reads of a running server's cache (``GetStats``), and the waits built on it."""

from __future__ import annotations

from kvtrio.client import Client
from kvtrio.launch import ServerProcess
from kvtrio.protocol import CacheStats, GetStats, StatsReply

from .waiting import wait_for

__all__ = ["assert_no_pins", "cache", "wait_chunks", "wait_l2_stored"]


def cache(server: ServerProcess) -> CacheStats:
    """The server's cache counters now."""
    with Client(server.endpoint, heartbeat=False, timeout=2.0) as client:
        stats = client.call(GetStats(), StatsReply).cache
    assert stats is not None
    return stats


def wait_chunks(server: ServerProcess, chunks: int) -> None:
    """Stores finish after their request does: wait until kvtrio holds ``chunks`` chunks."""
    wait_for(lambda: cache(server).l1_ready == chunks, what=f"{chunks} chunks in kvtrio")


def wait_l2_stored(server: ServerProcess, chunks: int) -> None:
    """Wait until the server's one L2 backend has written ``chunks`` objects. A backend that
    reports a failing store (a full disk, say) fails the wait at once, with its problem: a
    later miss would otherwise only say "0 tokens hit"."""

    def stored() -> bool:
        with Client(server.endpoint, heartbeat=False, timeout=2.0) as client:
            (backend,) = client.call(GetStats(), StatsReply).l2
        assert backend.healthy is not False, f"L2 {backend.name}: {backend.problem}"
        return backend.counters.get("stores", 0) >= chunks

    wait_for(stored, what=f"{chunks} chunks written to L2")


def assert_no_pins(server: ServerProcess) -> None:
    """Wait until every pin is released and nothing is left being written or leased (stores of
    requests still running finish on their own; a leak never does, and times out)."""

    def left() -> tuple[int, int, int]:
        stats = cache(server)
        return stats.l1_pins, stats.l1_writing, stats.leases

    wait_for(lambda: left() == (0, 0, 0), what="every pin, write and lease to be released")
