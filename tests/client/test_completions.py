"""What a worker reports to its engine as done (``client/_completions.py``), without a server."""

from __future__ import annotations

from concurrent.futures import Future

from kvtrio.client._completions import Completions


def test_stores_are_done_once_the_engine_finished_the_request_and_every_store_ended() -> None:
    completions = Completions()
    first, second = Future[None](), Future[None]()
    completions.store_submitted("r", first)
    completions.store_submitted("r", second)
    assert completions.finished(["r"]) == (set(), set())  # both stores still running
    completions.store_ended("r", first)
    assert first.done()
    assert completions.open_stores() == [second]
    assert completions.finished([]) == (set(), set())  # one still running
    completions.store_ended("r", second)
    assert completions.finished([]) == ({"r"}, set())  # the engine said so before
    assert completions.finished(["r"]) == (set(), set())  # reported once


def test_stores_of_a_request_the_engine_has_not_finished_wait_for_it() -> None:
    completions = Completions()
    done = Future[None]()
    completions.store_submitted("r", done)
    completions.store_ended("r", done)
    assert completions.finished(["other"]) == (set(), set())
    assert completions.finished(["r"]) == ({"r"}, set())


def test_retrieves_are_done_when_all_ended_and_failed_blocks_are_reported_once() -> None:
    completions = Completions()
    completions.retrieve_submitted("r")
    completions.retrieve_submitted("r")
    completions.retrieve_submitted("gone")
    completions.retrieve_not_run("gone")  # shut down before it ran: never reported
    completions.retrieve_ended("r", {3, 4})
    assert completions.finished([]) == (set(), set())
    completions.retrieve_ended("r", set())
    assert completions.finished([]) == (set(), {"r"})
    assert completions.finished([]) == (set(), set())
    assert completions.failed_blocks() == {3, 4}
    assert completions.failed_blocks() == set()
