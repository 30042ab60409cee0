"""The shared-memory arena's mapping: populated for workers, without stopping their threads."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtrio.shm import SharedArena
from kvtrio.shm import _arena as arena_module

SIZE = 256 << 20

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="page tables are populated on Linux"
)


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[SharedArena]:
    shm = Path("/dev/shm")
    created = SharedArena.create(SIZE, directory=str(shm if shm.is_dir() else tmp_path))
    created.preallocate()  # as the server does
    yield created
    created.close()


def resident(path: str) -> int:
    """Bytes of this process's mappings of ``path`` in memory (``Rss`` in /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
            inside = line.endswith(path)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.parametrize("kernel", ["madvise", "before 5.14"])
def test_attach_populates_the_whole_mapping(
    arena: SharedArena, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernel == "before 5.14":  # no MADV_POPULATE_WRITE: pages are touched from numpy
        monkeypatch.setattr(arena_module, "_MADV_POPULATE_WRITE", -1)  # EINVAL, like old kernels
    lazy = SharedArena.attach(arena.path, SIZE, populate=False)
    populated = SharedArena.attach(arena.path, SIZE)
    try:
        # The server's mapping (preallocate) and the populated one; the lazy one: untouched.
        assert resident(arena.path) >= 2 * SIZE
        populated.view(SIZE - 8, 8)[:] = 7  # and writable
        assert bytes(lazy.view(SIZE - 8, 8)) == b"\x07" * 8
    finally:
        lazy.close()
        populated.close()


def test_other_threads_run_while_a_mapping_is_populated(arena: SharedArena) -> None:
    """``mmap(MAP_POPULATE)`` held the GIL throughout: a client's heartbeat thread stopped."""
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        while not ticks:
            time.sleep(0.001)
        started = time.monotonic()
        attached = SharedArena.attach(arena.path, SIZE)
        finished = time.monotonic()
    finally:
        done.set()
        thread.join()
    attached.close()
    during = [t for t in ticks if started < t < finished]
    assert len(during) >= 5, f"{len(during)} ticks in {finished - started:.3f}s of populating"


def test_preallocate_populates_the_servers_mapping_so_that_first_writes_do_not_fault(
    arena: SharedArena,
) -> None:
    """The server zeroes a store's slots: unpopulated, each first write of a page faulted."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arena.view(0, 16 << 20).fill(0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < (16 << 20 >> 12) // 8  # unpopulated: one fault per 4 KiB page


def test_populating_holds_the_memory_map_lock_for_a_slice_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 22: one madvise over a 4 GiB arena held the process's memory-map lock for
    seconds, and every server thread that mapped memory (and every page fault behind it)
    waited: pings right after "serving" took up to 3.6 s. Now 16 MiB per call, and the
    server's populate stops between slices when told to."""
    calls: list[int] = []

    def madvise(address: int, length: int, advice: int) -> int:
        calls.append(length)
        return 0

    monkeypatch.setattr(arena_module, "_madvise", lambda: madvise)
    monkeypatch.setattr(arena_module.sys, "platform", "linux")
    buffer = np.zeros(100 << 20, dtype=np.uint8)
    arena_module.populate_pages(buffer)
    assert sum(calls) == buffer.nbytes
    assert max(calls) <= 16 << 20
    calls.clear()
    stop = threading.Event()
    stop.set()
    arena_module.populate_pages(buffer, stop)
    assert calls == []
