"""Eviction inside a server: the store path hands each chunk's parent to the L1 policy, so a
full L1 keeps only chunks a lookup can reach (issue 11: with LRU, 230 evictions left 19 of 63
stored objects reachable), and ``--eviction lru`` still gives plain LRU for comparison."""

from __future__ import annotations

import attrs
import pytest

from kvtrio.config import ServerConfig
from kvtrio.protocol import (
    Commit,
    EndSession,
    GetStats,
    LayoutSpec,
    Lookup,
    LookupReply,
    StatsReply,
    Store,
    StoreReply,
)
from kvtrio.storage.keys import token_chunk_hashes

from .._support.serving import serving

CHUNK = 256
LAYOUT = LayoutSpec("flash_attn", 4, 256, 16, 2, 32, "float16")  # 256 KiB chunks
PROMPT_CHUNKS = 8


def prompt(number: int) -> tuple[int, ...]:
    start = 10_000 * (number + 1)
    return tuple(range(start, start + PROMPT_CHUNKS * CHUNK))


async def fill_and_count(config: ServerConfig) -> tuple[int, int]:
    """Store 6 prompts of 8 chunks into an L1 of 20; (chunks stored, chunks reachable)."""
    async with serving(config, LAYOUT, engine="w") as (_, worker, scheduler):
        for number in range(6):
            request = f"p{number}"
            tokens = prompt(number)
            hashes = token_chunk_hashes(tokens, CHUNK)
            reply = await worker.call(
                Store(request, 0, len(tokens), chunk_hashes=tuple(hashes)), StoreReply
            )
            written = tuple(hashes[slot.chunk] for slot in reply.slots if slot.status == "write")
            await worker.request(Commit(request, written=written))
        reachable = 0
        for number in range(6):
            hits = await scheduler.call(
                Lookup(
                    f"q{number}",
                    "m",
                    1,
                    chunk_hashes=tuple(token_chunk_hashes(prompt(number), CHUNK)),
                    engine="w",
                ),
                LookupReply,
            )
            reachable += hits.hit_chunks
            await scheduler.request(EndSession(f"q{number}", "m", engine="w"))
        cache = (await worker.call(GetStats(), StatsReply)).cache
        assert cache is not None
        return cache.l1_ready, reachable


@pytest.fixture
def config(server_config: ServerConfig) -> ServerConfig:
    return attrs.evolve(server_config, l1_size=20 * 256 * 1024)


async def test_a_full_l1_keeps_only_reachable_chunks(config: ServerConfig) -> None:
    stored, reachable = await fill_and_count(config)
    assert stored == 20
    assert reachable == stored


async def test_plain_lru_stays_selectable_and_strands_tails(config: ServerConfig) -> None:
    stored, reachable = await fill_and_count(attrs.evolve(config, eviction="lru"))
    assert stored == 20
    assert reachable < stored
