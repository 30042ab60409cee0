"""The disk L2 keeps cached KV private to the server's user."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvtrio.l2 import create_backend


async def test_disk_directory_is_created_0700(tmp_path: Path) -> None:
    root = tmp_path / "deep" / "l2"
    old = os.umask(0o022)
    try:
        backend = create_backend("disk", {"path": str(root)})
        assert await backend.store([b"k" * 16], [[memoryview(b"v" * 64)]]) == [True]
        await backend.aclose()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
