"""The client's threads run where its :class:`ThreadPlacement` says (CPUs, priority)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from kvtrio.client import Client, ThreadPlacement, WorkerAdapter

linux_only = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="thread placement is Linux's"
)


def _one_cpu() -> frozenset[int]:
    """The last CPU this process may use (a real placement, narrower than the default on a
    machine of more than one CPU)."""
    return frozenset({max(os.sched_getaffinity(0))})


def _placed(placement: ThreadPlacement) -> tuple[frozenset[int], int]:
    """CPUs and nice value of a new thread that applied ``placement``."""
    seen: list[tuple[frozenset[int], int]] = []

    def run() -> None:
        placement.apply()
        seen.append((frozenset(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def test_cpus_are_written_as_ranges() -> None:
    assert ThreadPlacement(frozenset({0, 1, 2, 5, 7, 8})).describe() == "CPUs 0-2,5,7-8"
    assert ThreadPlacement(nice=10).describe() == "inherited CPUs, nice +10"


def test_nice_is_an_increment_the_os_allows() -> None:
    with pytest.raises(ValueError, match="nice"):
        ThreadPlacement(nice=-1)


@linux_only
def test_a_thread_takes_its_cpus_and_priority_and_leaves_the_others_alone() -> None:
    before = (frozenset(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0))
    cpus, nice = _placed(ThreadPlacement(_one_cpu(), nice=3))
    assert cpus == _one_cpu()
    # nice is per thread on Linux (the getpriority above reads the calling thread's)
    tid_nice = nice - before[1]
    assert tid_nice == 3
    assert (frozenset(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0)) == before


@linux_only
def test_a_refused_placement_is_logged_and_the_thread_runs_as_it_was(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "kvtrio.client")
    cpus, _ = _placed(ThreadPlacement(frozenset({100_000})))
    assert cpus == frozenset(os.sched_getaffinity(0))
    assert "not placed" in caplog.text


@linux_only
def test_a_clients_io_thread_is_placed(tmp_path: Path) -> None:
    # A client connects lazily: no server needs to listen for its thread to start.
    with Client(f"ipc://{tmp_path}/none.sock", placement=ThreadPlacement(_one_cpu())) as c:
        assert frozenset(os.sched_getaffinity(c._thread.native_id)) == _one_cpu()  # type: ignore[arg-type]


@linux_only
def test_a_worker_adapters_transfer_and_io_threads_are_placed(tmp_path: Path) -> None:
    placement = ThreadPlacement(_one_cpu(), nice=2)
    adapter = WorkerAdapter(f"ipc://{tmp_path}/none.sock", "m", 1, 0, 16, placement=placement)
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        cpus, nice = adapter._transfers.submit(
            lambda: (frozenset(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0))
        ).result(timeout=10)
        assert (cpus, nice - base) == (_one_cpu(), 2)
        io = adapter.client._thread.native_id
        assert frozenset(os.sched_getaffinity(io)) == _one_cpu()  # type: ignore[arg-type]
    finally:
        adapter.shutdown()
