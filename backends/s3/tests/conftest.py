"""A SeaweedFS server for the whole session, and options for backends that use it."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtrio_s3 import S3Options

# kvtrio's test servers are test support in the repository (tests/_support, in no wheel):
# its root goes first on sys.path, so these tests also run from this folder (`pytest` here).
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests._support.seaweedfs import SeaweedFS, seaweedfs

BUCKET = "kvtrio-tests"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedFS]:
    """``weed mini`` on loopback ports, shared by the session (tests isolate by prefix)."""
    with seaweedfs() as server:
        yield server


def options_for(server: SeaweedFS, **overrides: Any) -> S3Options:
    """Options for a backend on ``server``: a unique prefix, the bucket created on first use."""
    values: dict[str, Any] = {
        "bucket": BUCKET,
        "endpoint": server.endpoint,
        "region": server.region,
        "prefix": f"t-{uuid.uuid4().hex[:12]}/",
        "access_key_id": server.access_key_id,
        "secret_access_key": server.secret_access_key,
        "allow_http": True,
        "create_bucket": True,
        "timeout": 10.0,
    }
    values.update(overrides)
    return S3Options(**values)
