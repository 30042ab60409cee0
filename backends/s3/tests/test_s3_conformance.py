"""The s3 backend runs kvtrio's conformance suite against a real S3 server (SeaweedFS)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
import trio
from kvtrio_s3 import S3Backend

from conftest import options_for
from kvtrio.l2 import Backend
from kvtrio.testing import BackendConformance
from tests._support.seaweedfs import SeaweedFS, seaweedfs


class TestS3(BackendConformance):
    @pytest.fixture
    async def backend(self, s3_server: SeaweedFS) -> AsyncIterator[Backend]:
        backend = S3Backend(options_for(s3_server))
        yield backend
        await backend.aclose()


class TestS3LargeObjects(TestS3):
    """Objects larger than SeaweedFS's 4 MB chunks: stored in pieces, must still never tear."""

    object_size = 5 << 20


_SERVERS: dict[int, SeaweedFS] = {}


@pytest.fixture(scope="class")
def private_s3() -> Iterator[SeaweedFS]:
    """A SeaweedFS of this class's own, which its fault case stops and starts again."""
    with seaweedfs() as server:
        yield server


class TestS3Faults(BackendConformance):
    """A real fault: the S3 service stopped (and started again: what was stored survives)."""

    fault_kinds = ("unavailable",)

    @pytest.fixture
    async def backend(self, private_s3: SeaweedFS) -> AsyncIterator[Backend]:
        if not private_s3.running:  # a failed fault case left it stopped
            await trio.to_thread.run_sync(private_s3.start)
        backend = S3Backend(options_for(private_s3, timeout=2.0))
        _SERVERS[id(backend)] = private_s3  # (pytest binds fixtures to another instance)
        yield backend
        del _SERVERS[id(backend)]
        await backend.aclose()

    @asynccontextmanager
    async def fault(self, backend: Backend, kind: str) -> AsyncIterator[None]:
        assert kind == "unavailable"
        server = _SERVERS[id(backend)]
        await trio.to_thread.run_sync(server.stop)
        try:
            yield
        finally:
            await trio.to_thread.run_sync(server.start)
