"""The disk backend beyond the conformance suite: a batch store that fails part-way."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrio.l2 import BackendError
from kvtrio.l2.disk import DiskBackend, DiskOptions


async def test_a_batch_store_failing_part_way_keeps_the_written_objects_only(
    tmp_path: Path,
) -> None:
    backend = DiskBackend(DiskOptions(path=str(tmp_path)))
    first, failing, last = b"\x00" * 32, b"\xff" * 32, b"\x01" * 32
    assert await backend.lookup_and_lock([]) == 0  # (the directories exist now)
    # A real fault: the failing object's bucket directory cannot be created (a file is there).
    (tmp_path / "objects" / "ff").write_bytes(b"not a directory")
    parts = [[b"h" * 100, b"p" * 1000]] * 3
    with pytest.raises(BackendError, match="writing an object failed"):
        await backend.store([first, failing, last], parts)
    assert await backend.lookup_and_lock([first]) == 1
    await backend.unlock([first])
    assert await backend.lookup_and_lock([failing]) == 0
    assert await backend.lookup_and_lock([last]) == 0
    buffers = [bytearray(100), bytearray(1000)]
    assert await backend.load([first], [buffers]) == [True]
    assert buffers == [bytearray(b"h" * 100), bytearray(b"p" * 1000)]
    stats = backend.statistics()
    assert (stats["objects"], stats["bytes"], stats["stores"], stats["errors"]) == (1, 1100, 1, 1)
    assert list((tmp_path / "tmp").iterdir()) == []  # the failed write left no temporary file
    assert [p.name for p in (tmp_path / "objects").glob("*/*")] == [first.hex()]

    # Once the fault is gone, the same batch stores everything.
    (tmp_path / "objects" / "ff").unlink()
    assert await backend.store([first, failing, last], parts) == [True, True, True]
    assert await backend.lookup_and_lock([first, failing, last]) == 3
    stats = backend.statistics()
    assert (stats["objects"], stats["bytes"]) == (3, 3300)
    await backend.aclose()
