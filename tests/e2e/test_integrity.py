"""Issue 10's defects, each reproduced with real processes: a real server and real worker
processes (``engine_worker.py``), the scheduler adapter in this process.

Each of these failed against the server and adapters of commit 420fcce (protocol 1): a request
id reused by another engine or for another prompt poisoned the cache, a store right after
registration vanished, a refused registration was never retried, ``num_blocks_per_chunk`` was
a property.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvtrio.client import SchedulerAdapter
from kvtrio.launch import ServerProcess

from .._support.e2e import (
    BLOCK,
    CHUNK,
    PROMPT,
    SOURCE,
    TARGET,
    Worker,
    cache,
    lookup,
)
from .._support.waiting import wait_for

OTHER = [t + 100_000 for t in PROMPT]  # another prompt of the same length


@pytest.fixture
def processes(server: ServerProcess) -> Iterator[Callable[..., Worker]]:
    """Worker processes started without waiting for their registration."""
    started: list[Worker] = []

    def start(layout: str = "flash_attn", *flags: str) -> Worker:
        worker = Worker(server.endpoint, "m", 1, 0, layout, flags)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


def retrieve_and_check(worker: Worker, request: str, tokens: list[int], chunks: int) -> None:
    """Retrieve ``chunks`` chunks into scrambled blocks; they must hold ``tokens``' KV."""
    blocks = TARGET[: chunks * CHUNK // BLOCK]
    worker("scramble", blocks=blocks)
    assert worker.retrieve(request, tokens, TARGET, end=chunks * CHUNK) == []
    assert worker("check", tokens=tokens, blocks=blocks)["wrong"] == []


def test_another_engine_reusing_a_request_id_never_poisons_a_prompt(
    workers: Callable[..., Worker], scheduler: Callable[..., SchedulerAdapter]
) -> None:
    """Defect 1: engine 1 looks up req-7 with prompt A, engine 2 looks up and stores req-7 with
    prompt B. Protocol 1 stored B's KV under A's keys, and a later A hit returned B's bytes."""
    engine1, engine2 = workers(), workers()
    sched1, sched2 = scheduler(), scheduler()
    assert lookup(sched1, "req-7", PROMPT) == 0
    assert lookup(sched2, "req-7", OTHER) == 0
    engine2("compute", tokens=OTHER, blocks=SOURCE)
    engine2.store("req-7", OTHER, SOURCE)
    assert lookup(sched1, "req-8", PROMPT) == 0  # nothing of A was ever stored
    assert lookup(sched1, "req-9", OTHER) == 10 * CHUNK  # B is found under its own keys
    retrieve_and_check(engine1, "req-9", OTHER, 10)


def test_a_request_id_reused_for_another_prompt_stores_that_prompt(
    workers: Callable[..., Worker], scheduler: Callable[..., SchedulerAdapter]
) -> None:
    """Defect 1, one process: after req-7 (prompt A) finished, req-7 comes again with prompt B
    (request counters after a restart). Protocol 1 silently put B under A's keys."""
    worker, sched = workers(), scheduler()
    worker("compute", tokens=PROMPT, blocks=SOURCE)
    worker.store("req-7", PROMPT, SOURCE)
    worker("compute", tokens=OTHER, blocks=SOURCE)
    worker.store("req-7", OTHER, SOURCE)
    assert lookup(sched, "a", PROMPT) == 10 * CHUNK
    retrieve_and_check(worker, "a", PROMPT, 10)
    assert lookup(sched, "b", OTHER) == 10 * CHUNK
    retrieve_and_check(worker, "b", OTHER, 10)


def test_two_engines_with_identical_request_ids_never_touch_each_others_pins(
    server: ServerProcess, workers: Callable[..., Worker]
) -> None:
    workers(), workers("m", 1, 0, "flash_attn", "--engine", "e2")
    worker = workers("m", 1, 0, "flash_attn", "--engine", "e1")
    sched1 = SchedulerAdapter(server.endpoint, "m", 1, 0, BLOCK, engine_id="e1")
    sched2 = SchedulerAdapter(server.endpoint, "m", 1, 0, BLOCK, engine_id="e2")
    try:
        wait_for(lambda: sched1.client.server_info and sched2.client.server_info)
        worker("compute", tokens=PROMPT, blocks=SOURCE)
        worker.store("s", PROMPT, SOURCE)
        assert lookup(sched1, "r", PROMPT) == 10 * CHUNK
        assert cache(server).l1_pins == 10
        sched2.free_lookup_locks("r")
        sched2.end_session("r")  # engine 2's request "r" is another request
        assert lookup(sched2, "probe", []) == 0  # (in order after the end_session)
        assert cache(server).l1_pins == 10
        retrieve_and_check(worker, "r", PROMPT, 10)  # consumes engine 1's pins
        sched1.end_session("r")
        wait_for(lambda: cache(server).l1_pins == 0, what="the pins to go")
    finally:
        sched1.close()
        sched2.close()


def test_a_store_submitted_right_after_registering_is_stored(
    processes: Callable[..., Worker], scheduler: Callable[..., SchedulerAdapter]
) -> None:
    """Defect 2: the store waited for nothing; its worker found no registration and dropped
    it, and get_finished reported it done."""
    worker = processes("flash_attn", "--store-at-once", "r0", str(4 * CHUNK))
    assert worker("wait", request="r0")["done"]
    assert lookup(scheduler(), "x", list(range(4 * CHUNK))) == 4 * CHUNK
    assert worker("metrics")["metrics"]["store_failures"] == {}


def test_two_profiles_of_one_model_coexist_and_a_refused_worker_retries(
    server: ServerProcess,
    workers: Callable[..., Worker],
    processes: Callable[..., Worker],
    scheduler: Callable[..., SchedulerAdapter],
) -> None:
    """Defect 3: the second profile of a model was refused (with the first engine's profile in
    the message) and never retried, even after the first engine left."""
    first = workers()  # float16, K and V
    second = processes("mla")  # another profile of the same model, another engine
    first.close()
    second.wait_registered()
    second("compute", tokens=PROMPT, blocks=SOURCE)
    second.store("a", PROMPT, SOURCE)
    assert lookup(scheduler(), "b", PROMPT) == 10 * CHUNK


def test_a_refused_worker_says_why_counts_its_failed_stores_and_retries(
    server: ServerProcess, processes: Callable[..., Worker]
) -> None:
    """Workers of one engine must agree; a refused one is not caching, says so once, counts
    the stores it could not do (reported finished all the same), and registers once it can."""
    first = processes("flash_attn", "--engine", "e")
    first.wait_registered()
    second = processes("mla", "--engine", "e")
    wait_for(
        lambda: second("metrics")["metrics"]["registration_failures"] >= 1,
        what="the refusal",
    )
    assert not second("registered")["registered"]
    second.store("s", PROMPT, SOURCE)  # reported finished ...
    failures = second("metrics")["metrics"]["store_failures"]
    assert failures == {"not_registered": 10}  # ... and counted, by cause
    first.close()
    wait_for(lambda: second("registered")["registered"], timeout=20, what="the retry")
    assert cache(server).registrations == 1


def test_num_blocks_per_chunk_is_a_method_as_in_vllm(server: ServerProcess) -> None:
    """Defect 4: vLLM's LMCacheMPSchedulerAdapter.num_blocks_per_chunk() is a method."""
    adapter = SchedulerAdapter(server.endpoint, "m", 1, 0, BLOCK)
    try:
        wait_for(lambda: adapter.client.server_info is not None)
        assert adapter.num_blocks_per_chunk() == CHUNK // BLOCK
    finally:
        adapter.close()
