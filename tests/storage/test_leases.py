"""Leases: one per (kind, request, owner, key), released exactly once by any route."""

from __future__ import annotations

from kvtrio.storage import LeaseKind, LeaseTable

LOOKUP, READ, WRITE = LeaseKind.LOOKUP, LeaseKind.READ, LeaseKind.WRITE


def test_add_merges_and_removal_is_idempotent() -> None:
    table = LeaseTable()
    first = table.add(LOOKUP, "r", "sched", b"k", 1, 10.0)
    again = table.add(LOOKUP, "r", "sched", b"k", 2, 20.0)
    assert first is again
    assert (first.count, first.expires_at, table.live) == (3, 20.0, 1)
    table.remove(first)
    table.remove(first)
    assert table.live == 0
    assert table.pop_request("r") == []


def test_lookup_pins_are_consumed_by_any_reader() -> None:
    table = LeaseTable()
    table.add(LOOKUP, "r", "sched", b"k", 2, 10.0)
    assert table.take_lookup("r", b"k") == 1
    assert table.take_lookup("r", b"k", 5) == 1
    assert table.take_lookup("r", b"k") == 0
    assert table.live == 0


def test_every_release_route_releases_once() -> None:
    table = LeaseTable()
    a = table.add(LOOKUP, "r1", "sched", b"a", 1, 10.0)
    b = table.add(READ, "r1", "worker", b"a", 1, 10.0)
    c = table.add(WRITE, "r2", "worker", b"c", 1, 5.0)
    assert table.pop_request("r1", [LOOKUP]) == [a]
    assert table.pop_request("r1", [LOOKUP]) == []
    assert set(table.pop_owner("worker")) == {b, c}
    assert table.pop_owner("worker") == []
    assert table.pop_expired(100.0) == []
    assert table.live == 0


def test_expiry_respects_extensions() -> None:
    table = LeaseTable()
    lease = table.add(READ, "r", "w", b"k", 1, 5.0)
    table.add(READ, "r", "w", b"k", 1, 15.0)  # extended
    assert table.pop_expired(10.0) == []
    assert table.next_expiry() == 15.0
    assert table.pop_expired(15.0) == [lease]
    assert table.expired_total == 1
    assert table.next_expiry() is None


def test_removed_leases_do_not_pile_up_until_their_expiry() -> None:
    """Was: every removed lease stayed in the expiry heap until its (distant) expiry."""
    table = LeaseTable()
    for i in range(20_000):
        lease = table.add(LeaseKind.READ, f"r{i}", "s", i.to_bytes(32, "big"), 1, 1e9)
        table.remove(lease)
    assert table.live == 0
    assert len(table._expiry) <= 1024 + 2
