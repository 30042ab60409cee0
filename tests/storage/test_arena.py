"""The L1 arena's pages are allocated and mapped by ``preallocate``, before any store."""

from __future__ import annotations

import os
import resource
import sys

import pytest

from kvtrio.storage import SharedArena


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split("-")[0].split(".")
    return (int(release[0]), int(release[1])) >= (major, minor)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _kernel_at_least(5, 14),
    reason="MADV_POPULATE_WRITE is Linux 5.14+",
)
def test_preallocate_maps_every_page_so_that_first_writes_do_not_fault() -> None:
    size = 16 << 20
    arena = SharedArena.create(size)
    try:
        arena.preallocate()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        arena.buffer[:] = 1  # what the server does to a store's slots: zero them
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < (size >> 12) // 8  # unmapped: one fault per 4 KiB page
    finally:
        arena.close()
