"""The s3 backend runs kvtrio's conformance suite against a real S3 server (SeaweedFS)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from conftest import options_for
from kvtrio_s3 import S3Backend

from kvtrio.l2 import Backend
from kvtrio.testing import BackendConformance
from kvtrio.testing._seaweedfs import SeaweedFS


class TestS3(BackendConformance):
    @pytest.fixture
    async def backend(self, s3_server: SeaweedFS) -> AsyncIterator[Backend]:
        backend = S3Backend(options_for(s3_server))
        yield backend
        await backend.aclose()


class TestS3LargeObjects(TestS3):
    """Objects larger than SeaweedFS's 4 MB chunks: stored in pieces, must still never tear."""

    object_size = 5 << 20
