"""Issue 22, item 3, end to end: L2 keeps what is used.

A real ``kvtrio serve`` process with a small L1 and a small disk L2. A hot prompt is served from
L1 again and again while cold prompts pass through L1 and L2 (more than the L2 holds); a clean
restart (SIGTERM, a new process: an empty L1) must still find the hot prompt in L2. Before,
L1 hits never reached L2's eviction policy: the hot prompt, stored once and never looked up in
L2, was the first to be evicted there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvtrio.client import Client
from kvtrio.launch import ServerProcess
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    Commit,
    EndSession,
    GetStats,
    LayoutSpec,
    Lookup,
    LookupReply,
    Register,
    StatsReply,
    Store,
    StoreReply,
)
from kvtrio.storage import token_chunk_hashes

from .._support.waiting import wait_for

CHUNK = 256
LAYOUT = LayoutSpec("flash_attn", 2, 64, 16, 2, 16, "float16")  # 64 KiB chunks
HOT = tuple(token_chunk_hashes(range(1, 1 + 8 * CHUNK), CHUNK))
COLD = [
    tuple(token_chunk_hashes(range(s, s + 8 * CHUNK), CHUNK)) for s in range(10**6, 10**7, 10**5)
]
COLD_PROMPTS = 30
"""8 chunks each: 240 chunks through an L2 that holds about 30."""
ARGS = ("--l1-size", "4MiB", "--heartbeat-timeout", "2", "--pin-ttl", "30")


def l2_counters(server: ServerProcess) -> dict[str, float]:
    with Client(server.endpoint, heartbeat=False) as client:
        return dict(client.call(GetStats(), StatsReply).l2[0].counters)


def served(scheduler: Client, request: str, hashes: tuple[bytes, ...]) -> LookupReply:
    reply = scheduler.call(Lookup(request, "m", 1, hashes, engine="w"), LookupReply)
    scheduler.request(EndSession(request, "m", engine="w"))
    return reply


def store(worker: Client, request: str, hashes: tuple[bytes, ...]) -> None:
    reply = worker.call(Store(request, 0, len(hashes) * CHUNK, hashes), StoreReply)
    worker.request(Commit(request, written=tuple(hashes[s.chunk] for s in reply.slots)))


def poll(condition: Callable[[], bool], timeout: float) -> bool:
    """Whether ``condition`` becomes true within ``timeout`` seconds (no failure if not)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_prompt_served_from_l1_stays_in_l2_across_a_restart(
    server_process: Callable[..., ServerProcess], short_dir: Path
) -> None:
    """Was: hot prompt hits after the restart 0 of 8 (evicted from L2 as the oldest)."""
    server = server_process(*ARGS, "--l2", f"disk:path={short_dir / 'l2'},capacity=2MiB")
    register = Register("w", "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS)
    with Client(server.endpoint) as worker, Client(server.endpoint) as scheduler:
        worker.request(register)
        store(worker, "hot", HOT)
        wait_for(lambda: l2_counters(server).get("stores", 0) >= 8, what="the hot prompt in L2")
        for i in range(20):
            assert served(scheduler, f"h{i}", HOT).hit_chunks == 8  # from L1
        # The hits reach L2's policy in batches (a task flushes them): give it its moment.
        poll(lambda: l2_counters(server).get("touches", 0) >= 8, timeout=5)
        for n, cold in enumerate(COLD[:COLD_PROMPTS]):
            store(worker, f"c{n}", cold)
            wait_for(
                lambda n=n: l2_counters(server).get("stores", 0) >= 8 * (n + 2),  # type: ignore[misc]
                what=f"cold prompt {n} in L2",
            )
            for i in range(3):
                assert served(scheduler, f"h{n}.{i}", HOT).hit_chunks == 8  # still from L1
        seen = l2_counters(server)
        assert seen["evictions"] >= 8 * COLD_PROMPTS - seen["objects"]  # L2 really turned over

    server.stop()  # SIGTERM: a clean stop
    server.start()  # a new process: L1 is empty, the disk L2 is what is left
    with Client(server.endpoint) as worker, Client(server.endpoint) as scheduler:
        worker.request(register)
        wait_for(lambda: l2_counters(server).get("objects", 0) > 0, what="the L2 index")
        reply = served(scheduler, "after", HOT)
        assert reply.hit_chunks == 8, f"hot prompt hits after the restart: {reply.hit_chunks}/8"
        with Client(server.endpoint, heartbeat=False) as client:
            cache = client.call(GetStats(), StatsReply).cache
        assert cache is not None
        assert cache.lookup_l2_chunks == 8
