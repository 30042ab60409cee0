"""The L1 index: states, pins, eviction (pinned never), capacity, quarantine; the allocator."""

from __future__ import annotations

import random

import pytest

from kvtrio.storage import LRU, Entry, ExtentAllocator, L1Cache, Reservation

KB = 4096


def ready(l1: L1Cache, key: bytes, nbytes: int = KB) -> Entry:
    entry = l1.reserve(key, nbytes)
    assert isinstance(entry, Entry)
    l1.commit(key)
    return entry


def test_written_entries_are_invisible_until_committed() -> None:
    l1 = L1Cache(16 * KB)
    entry = l1.reserve(b"a", KB)
    assert isinstance(entry, Entry)
    assert l1.get(b"a") is None
    assert l1.prefix([b"a"]) == 0
    assert l1.reserve(b"a", KB) is Reservation.IN_PROGRESS
    l1.commit(b"a")
    assert l1.get(b"a") is entry
    assert l1.reserve(b"a", KB) is Reservation.PRESENT
    l1.reserve(b"b", KB)
    l1.abort(b"b")
    assert l1.get(b"b") is None
    assert l1.stats().used_bytes == KB


def test_prefix_stops_at_the_first_missing_key() -> None:
    l1 = L1Cache(16 * KB)
    for key in (b"a", b"b", b"d"):
        ready(l1, key)
    assert l1.prefix([b"a", b"b", b"c", b"d"]) == 2
    assert l1.prefix([]) == 0


def test_lru_eviction_spares_pinned_and_recently_used_entries() -> None:
    l1 = L1Cache(4 * KB)
    for key in (b"1", b"2", b"3", b"4"):
        ready(l1, key)
    l1.pin(b"1")
    l1.prefix([b"2"])  # used: now most recent
    ready(l1, b"5")  # evicts the least recently used unpinned: 3
    assert l1.get(b"3") is None
    assert all(l1.get(k) for k in (b"1", b"2", b"4", b"5"))
    assert l1.stats().evictions == 1


def test_a_full_cache_of_pinned_entries_refuses_new_stores_and_evicts_nothing() -> None:
    l1 = L1Cache(4 * KB)
    for key in (b"1", b"2", b"3", b"4"):
        ready(l1, key)
        l1.pin(key)
    assert l1.reserve(b"5", KB) is Reservation.NO_SPACE
    assert all(l1.get(k) for k in (b"1", b"2", b"3", b"4"))
    assert l1.stats().evictions == 0
    assert l1.stats().store_failures == 1
    l1.unpin(b"2")
    assert isinstance(l1.reserve(b"5", KB), Entry)
    assert l1.get(b"2") is None


def test_pin_accounting() -> None:
    l1 = L1Cache(4 * KB)
    ready(l1, b"a")
    l1.pin(b"a", 3)
    assert (l1.stats().pins, l1.stats().pinned_entries) == (3, 1)
    l1.unpin(b"a", 2)
    with pytest.raises(ValueError, match="unpinning 2 of 1"):
        l1.unpin(b"a", 2)
    l1.unpin(b"a")
    assert (l1.stats().pins, l1.stats().pinned_entries) == (0, 0)
    with pytest.raises(KeyError):
        l1.pin(b"missing")


def test_a_pin_count_never_goes_negative() -> None:
    """Issue 32 items 1 and 9: ``pin(key, -3)`` was accepted; ``pins`` read -3 and another
    pin's entry became evictable while it was read."""
    l1 = L1Cache(4 * KB)
    ready(l1, b"a")
    l1.pin(b"a")
    for count in (0, -3):
        with pytest.raises(ValueError, match="at least 1"):
            l1.pin(b"a", count)
    with pytest.raises(ValueError, match="unpinning -1 of 1"):
        l1.unpin(b"a", -1)
    assert (l1.stats().pins, l1.stats().pinned_entries) == (1, 1)
    l1.unpin(b"a", 0)  # (nothing)
    assert (l1.stats().pins, l1.stats().pinned_entries) == (1, 1)
    l1.unpin(b"a")
    assert (l1.stats().pins, l1.stats().pinned_entries) == (0, 0)


def test_no_eviction_when_it_cannot_make_room() -> None:
    l1 = L1Cache(4 * KB)
    ready(l1, b"a", 2 * KB)
    l1.pin(b"a")
    ready(l1, b"b", KB)
    assert l1.reserve(b"big", 3 * KB) is Reservation.NO_SPACE
    assert l1.get(b"b") is not None  # evicting b would not have been enough


def test_quarantined_slots_are_reused_only_after_their_time() -> None:
    l1 = L1Cache(2 * KB)
    first = l1.reserve(b"a", KB)
    assert isinstance(first, Entry)
    l1.abort_quarantined(b"a", until=10.0)
    assert l1.get(b"a") is None
    ready(l1, b"b")
    assert l1.reserve(b"c", KB) is Reservation.NO_SPACE or l1.get(b"b") is None
    assert l1.next_quarantine_release() == 10.0
    assert l1.release_quarantine(9.0) == 0
    assert l1.release_quarantine(10.0) == 1
    assert l1.next_quarantine_release() is None


def test_random_operations_keep_the_books_straight() -> None:
    rng = random.Random(7)
    l1 = L1Cache(64 * KB, policy=LRU())
    pinned: dict[bytes, int] = {}
    for _ in range(5000):
        key = bytes([rng.randrange(40)])
        action = rng.random()
        if action < 0.5:
            entry = l1.reserve(key, rng.choice([KB, 2 * KB, 3 * KB]))
            if isinstance(entry, Entry):
                (l1.commit if rng.random() < 0.8 else l1.abort)(key)
        elif action < 0.75 and l1.get(key) is not None:
            l1.pin(key)
            pinned[key] = pinned.get(key, 0) + 1
        elif pinned:
            victim = rng.choice(list(pinned))
            l1.unpin(victim)
            pinned[victim] -= 1
            if not pinned[victim]:
                del pinned[victim]
        for key in pinned:
            assert l1.get(key) is not None, "a pinned entry disappeared"
        stats = l1.stats()
        assert stats.pins == sum(pinned.values())
        assert stats.used_bytes <= stats.capacity_bytes


def test_allocator_coalesces_back_to_one_range() -> None:
    rng = random.Random(1)
    allocator = ExtentAllocator(1 << 20, 4096)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.5:
            offset = rng.choice(list(live))
            allocator.free(offset, live.pop(offset))
        else:
            size = rng.choice([4096, 8192, 12288, 5000])
            offset = allocator.allocate(size)
            if offset is not None:
                end = offset + allocator.round(size)
                assert all(end <= o or o + allocator.round(n) <= offset for o, n in live.items()), (
                    "overlapping ranges"
                )
                live[offset] = size
        assert allocator.free_bytes == allocator.size - sum(map(allocator.round, live.values()))
    for offset in list(live):
        allocator.free(offset, live.pop(offset))
    assert allocator.largest_free() == allocator.size
