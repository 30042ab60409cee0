"""The worker's transfer thread (``kvtrio.client._lanes``): loads before stores, each lane in
order, and an executor's contract (results, exceptions, shutdown)."""

from __future__ import annotations

import threading

import pytest

from kvtrio.client._lanes import TransferLanes


def test_queued_loads_run_before_queued_stores_each_in_order() -> None:
    ran: list[str] = []
    gate = threading.Event()
    lanes = TransferLanes("test-lanes")
    try:
        busy = lanes.submit_later(gate.wait, 10)  # a store in progress
        futures = [
            lanes.submit_later(ran.append, "store 1"),
            lanes.submit(ran.append, "load 1"),
            lanes.submit_later(ran.append, "store 2"),
            lanes.submit(ran.append, "load 2"),
        ]
        gate.set()
        for future in [busy, *futures]:
            future.result(timeout=10)
    finally:
        lanes.shutdown()
    assert ran == ["load 1", "load 2", "store 1", "store 2"]


def test_results_and_exceptions_reach_the_futures() -> None:
    lanes = TransferLanes("test-lanes")
    try:
        assert lanes.submit(pow, 2, 10).result(timeout=10) == 1024
        assert lanes.submit_later(int, "12", base=3).result(timeout=10) == 5
        with pytest.raises(ZeroDivisionError):
            lanes.submit(lambda: 1 / 0).result(timeout=10)
        assert lanes.submit(str, 1).result(timeout=10) == "1"  # the thread lives on
    finally:
        lanes.shutdown()


def test_shutdown_runs_what_is_queued_then_refuses_more() -> None:
    ran: list[int] = []
    gate = threading.Event()
    lanes = TransferLanes("test-lanes")
    lanes.submit(gate.wait, 10)
    queued = [lanes.submit_later(ran.append, i) for i in range(3)]
    gate.set()
    lanes.shutdown(wait=True)
    assert ran == [0, 1, 2]
    assert all(f.done() for f in queued)
    with pytest.raises(RuntimeError):
        lanes.submit(ran.append, 4)


def test_the_initializer_runs_in_the_thread_first() -> None:
    seen: list[str] = []
    lanes = TransferLanes(
        "kvtrio-transfer-7_0", lambda: seen.append(threading.current_thread().name)
    )
    try:
        assert lanes.submit(lambda: threading.current_thread().name).result(timeout=10) == (
            "kvtrio-transfer-7_0"
        )
    finally:
        lanes.shutdown()
    assert seen == ["kvtrio-transfer-7_0"]


def test_a_failing_initializer_leaves_the_thread_running_calls() -> None:
    def broken() -> None:
        raise OSError("no such CPU")

    lanes = TransferLanes("test-lanes", broken)
    try:
        assert lanes.submit(int, "7").result(timeout=10) == 7
    finally:
        lanes.shutdown()


def test_a_waiting_store_is_overtaken_a_bounded_number_of_times() -> None:
    """A steady stream of loads does not hold a store back: after ``overtakes`` loads have
    passed it, it runs, and the loads go on."""
    ran: list[str] = []
    gate, running = threading.Event(), threading.Event()

    def load_in_progress() -> None:
        running.set()
        gate.wait(10)

    lanes = TransferLanes("test-lanes", overtakes=3)
    try:
        busy = lanes.submit(load_in_progress)
        assert running.wait(10)  # (it started before the store came)
        futures = [lanes.submit_later(ran.append, "store")]
        futures += [lanes.submit(ran.append, f"load {i}") for i in range(5)]
        gate.set()
        for future in [busy, *futures]:
            future.result(timeout=10)
    finally:
        lanes.shutdown()
    assert ran == ["load 0", "load 1", "load 2", "store", "load 3", "load 4"]


def test_overtakes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="overtakes"):
        TransferLanes("test-lanes", overtakes=0)
