"""Issue 11: what clients can make the server hold is bounded (shapes, requests, pins)."""

from __future__ import annotations

import attrs
import pytest

from kvtrio.client import open_client
from kvtrio.config import ServerConfig
from kvtrio.errors import BadRequest, ServerBusy
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import EndSession, LayoutSpec, LookupReply, Register
from kvtrio.server import open_server

from .test_l2_tier import CHUNK, LAYOUT, cache, lookup, running, store


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"num_blocks": 2**62},
            "num_blocks must be an integer in 1…4294967296, got 4611686018427387904",
        ),
        ({"num_heads": 2**40}, "num_heads must be an integer in 1…65536"),
        ({"num_layers": 0}, "num_layers must be an integer in 1…4096, got 0"),
        ({"head_dim": 4096, "num_layers": 4096}, "more than the whole L1 arena"),
    ],
)
async def test_an_impossible_registration_is_a_one_line_bad_request(
    server_config: ServerConfig, changes: dict[str, int], message: str
) -> None:
    """Was: 2^62 blocks accepted; 2^40 heads an `internal` error with a traceback."""
    layout: LayoutSpec = attrs.evolve(LAYOUT, **changes)
    async with open_server(server_config) as server, open_client(server.endpoint) as client:
        with pytest.raises(BadRequest) as info:
            await client.request(Register("w", "m", 1, 0, layout, "tokens/sha256-128/v1"))
        assert message in str(info.value)
        assert "\n" not in str(info.value)
        with pytest.raises(BadRequest, match="world_size must be an integer in 1…256"):
            await client.request(Register("w", "m", 2**20, 0, LAYOUT, "tokens/sha256-128/v1"))
        odd = attrs.evolve(LAYOUT, block_size=48)  # (still the registry's own message)
        with pytest.raises(BadRequest, match="block size 48 does not divide"):
            await client.request(Register("w", "m", 1, 0, odd, "tokens/sha256-128/v1"))
        server.stop()


async def test_requests_holding_pins_are_bounded_and_idle_ones_cost_nothing(
    server_config: ServerConfig,
) -> None:
    config = attrs.evolve(server_config, max_requests=3)
    async with running(config, MemoryBackend()) as (_, worker, scheduler):
        await store(worker, "a", 2)  # committed: "a" holds nothing, so it does not count
        for request in ("r1", "r2"):  # two lookups hit: they hold pins
            assert await lookup(scheduler, request, 2) == LookupReply(2 * CHUNK, 2)
        assert await lookup(scheduler, "r3", 2) == LookupReply(2 * CHUNK, 2)
        assert (await cache(worker)).requests == 3
        with pytest.raises(ServerBusy, match="max_requests"):
            await lookup(scheduler, "r4", 2)
        await scheduler.request(EndSession("r1", "m"))
        assert await lookup(scheduler, "r4", 2) == LookupReply(2 * CHUNK, 2)
        assert (await cache(worker)).requests == 3


async def test_pins_are_bounded(server_config: ServerConfig) -> None:
    config = attrs.evolve(server_config, max_pins=5)
    async with running(config, MemoryBackend()) as (_, worker, scheduler):
        await store(worker, "a", 4)
        assert await lookup(scheduler, "r1", 4) == LookupReply(4 * CHUNK, 4)
        with pytest.raises(ServerBusy, match="max_pins"):
            await lookup(scheduler, "r2", 4)
        await scheduler.request(EndSession("r1", "m"))
        assert await lookup(scheduler, "r2", 4) == LookupReply(4 * CHUNK, 4)
