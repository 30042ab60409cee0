"""A server in the test's trio loop with a registered worker client and a scheduler client: what
most server tests start with.

    async with serving(config, LAYOUT, [("l2", backend)]) as (server, worker, scheduler):
        ...
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import attrs

from kvtrio.client import AsyncClient, open_client
from kvtrio.config import ServerConfig
from kvtrio.l2 import Backend
from kvtrio.protocol import HASH_SCHEME_TOKENS, LayoutSpec, Register
from kvtrio.server import ServerHandle, open_server

__all__ = ["serving"]

_SERVERS = itertools.count()


@asynccontextmanager
async def serving(
    config: ServerConfig,
    layout: LayoutSpec,
    backends: Sequence[tuple[str, Backend]] = (),
    *,
    engine: str = "",
) -> AsyncIterator[tuple[ServerHandle, AsyncClient, AsyncClient]]:
    """A server over ``backends`` (none: no L2, whatever ``config.l2`` says), a worker client
    registered as ``engine`` for model ``m`` (one rank, token mode, ``layout``) and a scheduler
    client; the server is stopped at exit.

    Each server on an ipc endpoint gets an endpoint of its own: libzmq closes a stopped server's
    ipc listener asynchronously, so a server started right after on the same path could find it
    still accepting and refuse to start ("in use by another process")."""
    if config.endpoint.startswith("ipc://"):
        config = attrs.evolve(config, endpoint=f"{config.endpoint}.{next(_SERVERS)}")
    async with (
        open_server(config, backends=list(backends)) as server,
        open_client(server.endpoint) as worker,
        open_client(server.endpoint) as scheduler,
    ):
        await worker.request(Register(engine, "m", 1, 0, layout, HASH_SCHEME_TOKENS))
        yield server, worker, scheduler
        server.stop()
