"""The shared arena's file: attached by path, bounds-checked views, leftovers reclaimed."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvtrio.shm import SharedArena, reclaim_stale_arenas


def test_shared_arena_is_visible_to_an_attached_mapping(tmp_path: object) -> None:
    arena = SharedArena.create(1 << 20)
    try:
        other = SharedArena.attach(arena.path, arena.size)
        arena.view(4096, 8)[:] = 7
        assert bytes(other.view(4096, 8)) == b"\x07" * 8
        other.close()
        with pytest.raises(ValueError, match="outside the arena"):
            arena.view(arena.size - 4, 8)
        with pytest.raises(OSError, match="expected"):
            SharedArena.attach(arena.path, arena.size * 2)
    finally:
        arena.close()
    with pytest.raises(FileNotFoundError):
        SharedArena.attach(arena.path, 4096)


def test_a_dead_owners_arena_is_reclaimed_and_a_live_ones_is_not(short_dir: Path) -> None:
    live = SharedArena.create(1 << 20, directory=str(short_dir))
    leftover = short_dir / "kvtrio-0123.l1"
    leftover.write_bytes(b"\0" * 4096)  # as left by a server killed with SIGKILL
    unrelated = short_dir / "other.l1"
    unrelated.write_bytes(b"x")
    try:
        assert reclaim_stale_arenas(str(short_dir)) == [str(leftover)]
        assert Path(live.path).exists()
        assert unrelated.exists()
        again = SharedArena.create(1 << 20, directory=str(short_dir))  # reclaims on creation too
        again.close()
    finally:
        live.close()
    assert not Path(live.path).exists()


def test_an_arena_being_created_is_never_reclaimed(short_dir: Path) -> None:
    """Another server starting at the same moment reclaims leftovers: it must never take a
    file that its creator has not locked yet."""
    stop = threading.Event()
    reclaimed: list[str] = []

    def reclaim_continuously() -> None:
        while not stop.is_set():
            reclaimed.extend(reclaim_stale_arenas(str(short_dir)))

    thread = threading.Thread(target=reclaim_continuously)
    thread.start()
    try:
        for _ in range(300):
            arena = SharedArena.create(4096, directory=str(short_dir))
            try:
                assert Path(arena.path).exists()
            finally:
                arena.close()
    finally:
        stop.set()
        thread.join()
    assert reclaimed == []
