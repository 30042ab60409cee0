"""The synchronous relay of a server's KV events (``kvtrio.client.EventRelay``): in order, and
anew when the server starts again, however many subscribers its topic has."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from kvtrio.client import AsyncClient, EventRelay, open_client
from kvtrio.config import ServerConfig
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    AllBlocksCleared,
    BlockStored,
    Commit,
    KVEvent,
    LayoutSpec,
    Register,
    Store,
    StoreReply,
    events_topic,
    replay_endpoint,
)
from kvtrio.server import open_server
from kvtrio.storage import token_chunk_hashes

from .._support.waiting import await_condition

CHUNK = 256
LAYOUT = LayoutSpec("flash_attn", 4, 256, 16, 2, 32, "float16")


@pytest.fixture
def config(server_config: ServerConfig, short_dir: Path) -> ServerConfig:
    events = f"ipc://{short_dir}/events"
    return attrs.evolve(server_config, l1_size=8 << 20, events=events, events_interval=0.002)


@pytest.fixture
def relays(config: ServerConfig) -> Iterator[list[EventRelay]]:
    assert config.events is not None
    made = [
        EventRelay(config.events, replay_endpoint(config.events), events_topic(""))
        for _ in range(2)
    ]
    try:
        yield made
    finally:
        for relay in made:
            relay.close()


async def test_every_subscriber_of_a_topic_sees_the_server_start_again(
    config: ServerConfig, relays: list[EventRelay]
) -> None:
    """Two relays of one topic; the server stops and starts again. Was: the restart was told
    by a batch numbered 0, which only the topic's first subscriber gets, so the other relay
    kept the old stream's knowledge and dropped the new stream's batches as duplicates."""
    seen: list[list[KVEvent]] = [[], []]
    seeds = itertools.count(1)

    def count(kind: type[KVEvent]) -> list[int]:
        for relay, events in zip(relays, seen, strict=True):
            events.extend(relay.take())
        return [sum(type(e) is kind for e in events) for events in seen]

    async def store_one(worker: AsyncClient, stored: int) -> None:
        """Store a chunk and wait until both relays have it (one batch per store)."""
        seed = next(seeds)
        hashes = tuple(token_chunk_hashes(range(seed * 10_000, seed * 10_000 + CHUNK), CHUNK))
        reply = await worker.call(Store(f"r{seed}", 0, CHUNK, hashes), StoreReply)
        assert [slot.status for slot in reply.slots] == ["write"]
        await worker.request(Commit(f"r{seed}", written=hashes))
        await await_condition(lambda: count(BlockStored) == [stored, stored], what="relayed")

    stored = 0
    for stores in (8, 3):  # the second server's stream stays below the first's numbers
        async with open_server(config) as server, open_client(server.endpoint) as worker:
            await worker.request(Register("e", "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS))
            counters = server.state.events.counters  # type: ignore[union-attr]
            await await_condition(
                lambda: counters["subscriptions"] >= 2,  # noqa: B023 (awaited here)
                what="both relays subscribed",
            )
            for _ in range(stores):
                stored += 1
                await store_one(worker, stored)
    cleared = count(AllBlocksCleared)
    assert min(cleared) >= 2  # each stream's start, in each relay
    assert count(BlockStored) == [11, 11]
    assert [relay.lost for relay in relays] == [0, 0]
