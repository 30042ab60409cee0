"""The lock counts and deferred deletes of backends that lock in their own process
(``kvtrio.l2._locks.LocalLocks``)."""

from __future__ import annotations

from kvtrio.l2 import LocalLocks

KEY = b"k" * 32


def doomed_and_locked() -> LocalLocks:
    locks = LocalLocks()
    locks.lock([KEY])
    assert locks.defer_delete(KEY)
    return locks


def test_a_delete_deferred_by_a_lock_is_due_at_the_last_unlock() -> None:
    locks = doomed_and_locked()
    locks.lock([KEY])
    assert locks.unlock([KEY]) == []
    assert locks.is_doomed(KEY)
    assert locks.unlock([KEY]) == [KEY]
    assert not locks.is_doomed(KEY)


def test_the_last_unlock_during_a_store_leaves_the_delete_to_the_stores_outcome() -> None:
    """Was: due at the unlock, so a backend whose store the service had applied (its answer
    not seen yet) deleted the new object."""
    locks = doomed_and_locked()
    locks.storing([KEY])
    assert locks.unlock([KEY]) == []
    assert locks.is_doomed(KEY)  # (lookups still do not find it)
    assert locks.stored(KEY, True) is False  # the new object: the delete was for the old one
    assert not locks.is_doomed(KEY)
    assert locks.deferred_deletes == 0


def test_a_store_that_failed_after_the_last_unlock_makes_the_delete_due() -> None:
    locks = doomed_and_locked()
    locks.storing([KEY])
    locks.storing([KEY])
    assert locks.unlock([KEY]) == []
    assert locks.stored(KEY, False) is False  # another store of the key is still in flight
    assert locks.stored(KEY, False) is True  # none left, none succeeded: the old one goes
    assert not locks.is_doomed(KEY)


def test_a_store_before_the_last_unlock_changes_nothing_of_it() -> None:
    locks = doomed_and_locked()
    locks.storing([KEY])
    assert locks.stored(KEY, False) is False
    assert locks.unlock([KEY]) == [KEY]  # the store failed: the deferred delete, as before
