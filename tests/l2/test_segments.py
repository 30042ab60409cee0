"""The disk backend's segment bookkeeping (no files): allocation, give-back, reads in progress."""

from __future__ import annotations

from kvtrio.l2._diskio import record_size
from kvtrio.l2._segments import Frees, Segments

RECORD = record_size(1000)  # one block


def test_records_are_appended_until_the_segment_is_full() -> None:
    space = Segments(3 * RECORD)
    assert [space.allocate(1000) for _ in range(4)] == [
        (0, 0, 1000),
        (0, RECORD, 1000),
        (0, 2 * RECORD, 1000),
        (1, 0, 1000),
    ]
    assert space.allocate(10 * RECORD)[:2] == (2, 0)  # too large: a segment of its own
    assert space.allocate(1000)[:2] == (3, 0)
    assert len(space) == 4
    assert space.take_frees() is None


def test_a_segment_goes_with_its_last_record_unless_it_is_active() -> None:
    space = Segments(2 * RECORD)
    first, second, third = (space.allocate(1000) for _ in range(3))
    space.release(first)
    space.release(second)
    assert space.take_frees() == Frees(punches=[first], unlinks=[0])
    space.release(third)  # the active segment: punched, kept for the next record
    assert space.take_frees() == Frees(punches=[third])
    fourth = space.allocate(1000)
    assert fourth[:2] == (1, RECORD)
    space.release(fourth)
    space.allocate(1000)  # segment 1 is full and empty: it goes as segment 2 starts
    assert space.take_frees() == Frees(punches=[fourth], unlinks=[1])
    assert len(space) == 1


def test_a_record_is_given_back_after_its_last_read() -> None:
    space = Segments(4 * RECORD)
    record, other = space.allocate(1000), space.allocate(1000)
    space.start_reading(record)
    space.start_reading(record)
    space.release(record)
    assert space.take_frees() is None
    space.done_reading(record)
    assert space.take_frees() is None
    space.done_reading(record)
    assert space.take_frees() == Frees(punches=[record])
    space.start_reading(other)  # a read that ends with nothing given back
    space.done_reading(other)
    assert space.take_frees() is None


def test_scanned_segments_are_counted_and_new_records_go_after_them() -> None:
    space = Segments(4 * RECORD)
    space.scanned(3, 2)
    space.scanned(7, 1)
    assert space.allocate(1000)[:2] == (8, 0)
    space.release((7, 0, 1000))
    assert space.take_frees() == Frees(unlinks=[7])
    assert len(space) == 2
