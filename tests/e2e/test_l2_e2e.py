"""End to end through L2: what one server process stored, the next one serves, byte for byte.

Each backend of the cascade is exercised on its own (with an empty disk, where it is not
``disk``): store through a worker process, wait for the write-behind, restart the server, look
up (the hits come from L2), retrieve into other blocks, compare every layer's bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvtrio.client import SchedulerAdapter

from ..conftest import ServerProcess, wait_for
from .test_cache_e2e import (
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
