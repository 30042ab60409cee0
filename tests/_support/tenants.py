"""Two tenants on one CURVE server, and the CPU worker's store as the tenant tests do it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs

from kvtrio.client import AsyncClient, open_client
from kvtrio.config import ServerConfig
from kvtrio.l2 import Backend
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    Commit,
    CommitReply,
    LayoutSpec,
    Register,
    Registered,
    Store,
    StoreReply,
)
from kvtrio.server import ServerHandle, open_server
from kvtrio.shm import SharedArena
from kvtrio.transport import write_keypair

__all__ = [
    "ARENA_CHUNKS",
    "CHUNK",
    "CHUNK_BYTES",
    "LAYOUT",
    "hashes",
    "register",
    "store",
    "tcp_config",
    "tenant_clients",
]

CHUNK = 256
LAYOUT = LayoutSpec("flash_attn", 2, 64, 16, 2, 16, "float16")
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 16 * 2  # 64 KiB
ARENA_CHUNKS = 64


def tcp_config(**overrides: Any) -> ServerConfig:
    """A server on loopback tcp (CURVE), 16 MiB of L1, no L2 (every chunk written to one a
    test gives), and ``overrides``."""
    defaults = {"endpoint": "tcp://127.0.0.1:0", "l1_size": 16 << 20, "l2": ()}
    return ServerConfig(**{**defaults, "l2_admission": "all", **overrides})


@asynccontextmanager
async def tenant_clients(
    short_dir: Path,
    config: ServerConfig,
    backends: Sequence[tuple[str, Backend]] | None = None,
    cuda_runtime: Any = None,
) -> AsyncIterator[tuple[ServerHandle, AsyncClient, AsyncClient]]:
    """A server allowing two keys, ``acme`` (tenant acme) and ``victim`` (tenant victim);
    ``backends``, if given, instead of ``config.l2``'s; ``cuda_runtime`` its CUDA runtime
    factory (a simulated GPU)."""
    keys = short_dir / "tenants"
    write_keypair(keys / "clients", "acme", "acme")
    write_keypair(keys / "clients", "victim", "victim")
    write_keypair(keys, "server")
    for name in ("acme", "victim"):
        (keys / "clients" / f"{name}.key_secret").rename(keys / f"{name}.key_secret")
    config = attrs.evolve(
        config,
        curve_secret_key=str(keys / "server.key_secret"),
        curve_allowed_keys=str(keys / "clients"),
    )
    server_key = str(keys / "server.key")
    async with (
        open_server(config, backends=backends, cuda_runtime=cuda_runtime) as server,
        open_client(
            server.endpoint, server_key=server_key, client_key=str(keys / "acme.key_secret")
        ) as acme,
    ):
        await acme.wait_connected()  # acme's session first (the session-limit test needs it)
        async with open_client(
            server.endpoint, server_key=server_key, client_key=str(keys / "victim.key_secret")
        ) as victim:
            yield server, acme, victim


def hashes(seed: int, count: int) -> tuple[bytes, ...]:
    """``count`` distinct chunk hashes of ``seed``."""
    return tuple(seed.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(count))


async def register(client: AsyncClient, tenant: str) -> Registered:
    """Register a flash_attn worker of model ``m`` for ``tenant``."""
    return await client.call(
        Register("w", "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS, tenant=tenant), Registered
    )


async def store(
    client: AsyncClient,
    arena: SharedArena,
    request: str,
    chunk_hashes: tuple[bytes, ...],
    fill: int,
) -> int:
    """Store chunks the way a CPU worker does (write the slots, commit); returns the count."""
    reply = await client.call(
        Store(request, 0, len(chunk_hashes) * CHUNK, chunk_hashes=chunk_hashes), StoreReply
    )
    written = []
    for slot in reply.slots:
        if slot.status == "write":
            arena.view(slot.offset, slot.nbytes).fill(fill)
            written.append(chunk_hashes[slot.chunk])
    committed = await client.call(Commit(request, written=tuple(written)), CommitReply)
    assert not committed.rejected
    return committed.committed
