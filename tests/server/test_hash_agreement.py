"""Engines of one model and tenant in hash mode must agree on their block hashes: the same
algorithm and the same root (its fingerprint travels in ``register``). One that disagrees is
refused with one line that says what to set; otherwise it would share nothing, silently."""

from __future__ import annotations

import pytest

from kvtrio.client import open_client
from kvtrio.config import ServerConfig
from kvtrio.errors import Incompatible
from kvtrio.protocol import HASH_SCHEME_TOKENS, LayoutSpec, Register
from kvtrio.server import open_server

from .._support.waiting import await_async

LAYOUT = LayoutSpec("flash_attn", 4, 64, 16, 2, 32, "float16")
SHA256 = "blocks/sha256/v1"


def register(engine: str, scheme: str = SHA256, seed: str = "f00d") -> Register:
    return Register(engine, "m", 1, 0, LAYOUT, scheme, hash_seed=seed)


async def test_engines_with_another_root_or_algorithm_are_refused(
    server_config: ServerConfig,
) -> None:
    async with (
        open_server(server_config, backends=[]) as server,
        open_client(server.endpoint) as first,
        open_client(server.endpoint) as second,
        open_client(server.endpoint) as third,
    ):
        await first.request(register("e1"))
        await second.request(register("e2"))  # the same algorithm and root: shares
        with pytest.raises(Incompatible) as refused:
            await third.request(register("e3", seed="bb"))
        message = str(refused.value)
        assert "\n" not in message
        assert "another root hash" in message
        assert "PYTHONHASHSEED" in message
        assert "prefix_caching_hash_algo" in message
        assert "f00d" not in message  # never the other engines' fingerprint
        with pytest.raises(Incompatible, match="'blocks/sha256/v1', not 'blocks/xxhash/v1'"):
            await third.request(register("e3", scheme="blocks/xxhash/v1"))
        # Other models, and token mode, are other namespaces: left alone.
        await third.request(Register("e3", "m2", 1, 0, LAYOUT, SHA256, hash_seed="bb"))
        await third.request(register("e3", HASH_SCHEME_TOKENS, seed=""))
        server.stop()


async def test_a_fleet_may_change_its_seed_once_its_engines_are_gone(
    server_config: ServerConfig,
) -> None:
    async with open_server(server_config, backends=[]) as server:
        async with open_client(server.endpoint) as old:
            await old.request(register("e1"))
        async with open_client(server.endpoint) as new:

            async def registered() -> bool:
                try:
                    await new.request(register("e2", seed="bb"))
                except Incompatible:
                    return False  # the old engine's session is not over yet
                return True

            await await_async(registered, what="the old engine's registration to go")
        server.stop()
