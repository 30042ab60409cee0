"""End to end on real processes: a kvtrio server, engine worker processes, a scheduler adapter.

Workers hold their KV cache in ordinary CPU memory and copy through the shared L1 arena; every
retrieve is checked byte for byte, layer by layer, against what was stored.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtrio.client import Client, SchedulerAdapter
from kvtrio.errors import BadRequest, Incompatible, NotRegistered
from kvtrio.launch import ServerProcess
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    Commit,
    CommitReply,
    EndSession,
    LayoutSpec,
    Lookup,
    LookupReply,
    Register,
    Store,
)

from .._support.e2e import (
    BLOCK,
    CHUNK,
    HASHES,
    PER_CHUNK,
    PROMPT,
    SOURCE,
    TARGET,
    Worker,
    assert_same_bytes,
    cache,
    chunk_blocks,
    lookup,
)
from .._support.waiting import wait_for

# --------------------------------------------------------------------------- the happy path


@pytest.mark.parametrize("layout", ["flash_attn", "flash_infer", "cpu", "vllm_cpu"])
def test_store_lookup_retrieve_into_other_blocks_bytes_equal(
    workers: Callable[..., Worker],
    scheduler: Callable[..., SchedulerAdapter],
    server: ServerProcess,
    layout: str,
) -> None:
    worker = workers("m", 1, 0, layout)
    sched = scheduler()
    worker("fill", seed=1)
    before = [worker.digests(chunk_blocks(SOURCE, c)) for c in range(10)]
    worker.store("first", PROMPT, SOURCE)
    assert lookup(sched, "second", [*PROMPT, 1, 2, 3]) == 10 * CHUNK  # the prompt plus new tokens
    assert worker.retrieve("second", [*PROMPT, 1, 2, 3], TARGET, end=10 * CHUNK) == []
    assert_same_bytes(worker, before, TARGET, 10)
    sched.end_session("second")
    wait_for(lambda: cache(server).l1_pins == 0, what="every pin to be released")
    assert cache(server).leases == 0


def test_a_request_id_longer_than_the_bound_is_cached_as_any_other(
    workers: Callable[..., Worker],
    scheduler: Callable[..., SchedulerAdapter],
    server: ServerProcess,
) -> None:
    """Issue 32 bounded request ids at 512 characters; a longer engine id (a long
    ``X-Request-Id``) travels as its digest, the same from the scheduler and the worker, so its
    store, lookup, retrieve and end hit and release as a short id's do (not ``bad_request``)."""
    long_store, long_read = "s" * 600, "r" * 5000
    worker = workers("m", 1, 0, "vllm_cpu")
    sched = scheduler()
    worker("fill", seed=3)
    before = [worker.digests(chunk_blocks(SOURCE, c)) for c in range(10)]
    worker.store(long_store, PROMPT, SOURCE)
    assert lookup(sched, long_read, PROMPT) == 10 * CHUNK
    assert cache(server).l1_pins > 0
    assert worker.retrieve(long_read, PROMPT, TARGET, end=10 * CHUNK) == []
    assert_same_bytes(worker, before, TARGET, 10)
    sched.end_session(long_read)
    wait_for(lambda: cache(server).l1_pins == 0, what="every pin to be released")
    assert cache(server).leases == 0


def test_a_retrieve_leaves_the_blocks_the_engine_has_alone(
    workers: Callable[..., Worker], scheduler: Callable[..., SchedulerAdapter]
) -> None:
    """The engine's own prefix cache had 1.5 chunks: the retrieve starts at chunk 1 and writes
    neither the blocks of chunk 0 nor the first half of chunk 1."""
    worker = workers("m", 1, 0, "vllm_cpu")
    sched = scheduler()
    worker("fill", seed=3)
    before = [worker.digests(chunk_blocks(SOURCE, c)) for c in range(4)]
    worker.store("first", PROMPT[: 4 * CHUNK], SOURCE)
    assert lookup(sched, "second", PROMPT[: 4 * CHUNK]) == 4 * CHUNK
    skip = PER_CHUNK // 2
    mine = [worker.digests([b]) for b in TARGET[PER_CHUNK : PER_CHUNK + skip]]
    failed = worker.retrieve(
        "second", PROMPT[: 4 * CHUNK], TARGET, end=4 * CHUNK, start=CHUNK, skip=skip * BLOCK
    )
    assert failed == []
    assert [worker.digests([b]) for b in TARGET[PER_CHUNK : PER_CHUNK + skip]] == mine
    assert worker.digests(TARGET[PER_CHUNK + skip : 2 * PER_CHUNK]) == worker.digests(
        SOURCE[PER_CHUNK + skip : 2 * PER_CHUNK]
    )
    assert_same_bytes(worker, before[2:], TARGET[2 * PER_CHUNK :], 2)


def test_engines_with_different_layouts_of_one_model_share_chunks(
    workers: Callable[..., Worker], scheduler: Callable[..., SchedulerAdapter]
) -> None:
    writer = workers("shared", 1, 0, "flash_attn")
    reader = workers("shared", 1, 0, "flash_infer")
    sched = scheduler("shared")
    writer("fill", seed=6)
    before = [writer("canonical", blocks=chunk_blocks(SOURCE, c))["digest"] for c in range(10)]
    writer.store("a", PROMPT, SOURCE)
    assert lookup(sched, "b", PROMPT) == 10 * CHUNK
    assert reader.retrieve("b", PROMPT, TARGET, end=10 * CHUNK) == []
    after = [reader("canonical", blocks=chunk_blocks(TARGET, c))["digest"] for c in range(10)]
    assert after == before


def test_partial_prefix(
    workers: Callable[..., Worker],
    scheduler: Callable[..., SchedulerAdapter],
    server: ServerProcess,
) -> None:
    worker = workers()
    sched = scheduler()
    worker("fill", seed=2)
    worker.store("first", PROMPT, SOURCE)
    diverging = PROMPT[: 6 * CHUNK + 100] + [7] * (4 * CHUNK)  # differs inside chunk 6
    assert lookup(sched, "partial", diverging) == 6 * CHUNK
    sched.end_session("partial")
    assert lookup(sched, "unrelated", [9] * (3 * CHUNK)) == 0


def test_hash_mode(
    workers: Callable[..., Worker], scheduler: Callable[..., SchedulerAdapter]
) -> None:
    from .engine_worker import block_hashes

    worker = workers("hashed", 1, 0, "flash_attn", "--hash-mode")
    sched = scheduler("hashed")
    worker("fill", seed=3)
    before = [worker.digests(chunk_blocks(SOURCE, c)) for c in range(10)]
    worker.store("first", PROMPT, SOURCE)
    assert lookup(sched, "second", None, block_hashes=block_hashes(PROMPT)) == 10 * CHUNK
    assert worker.retrieve("second", PROMPT, TARGET, end=10 * CHUNK) == []
    assert_same_bytes(worker, before, TARGET, 10)
    # keys computed from the tokens name other chunks than the engine's block hashes: a miss
    assert lookup(sched, "x", PROMPT) == 0


def test_world_size_two_counts_only_chunks_both_ranks_have(
    workers: Callable[..., Worker],
    scheduler: Callable[..., SchedulerAdapter],
    server: ServerProcess,
) -> None:
    rank0 = workers("tp", 2, 0)
    rank1 = workers("tp", 2, 1)
    sched = scheduler("tp", 2)
    for worker, seed in ((rank0, 10), (rank1, 20)):
        worker("fill", seed=seed)
    before = {w: [w.digests(chunk_blocks(SOURCE, c)) for c in range(10)] for w in (rank0, rank1)}
    rank0.store("a", PROMPT, SOURCE)
    rank1.store("a", PROMPT[: 7 * CHUNK], SOURCE[: 7 * PER_CHUNK])
    assert lookup(sched, "b", PROMPT) == 7 * CHUNK
    for worker in (rank0, rank1):
        assert worker.retrieve("b", PROMPT, TARGET, end=7 * CHUNK) == []
        assert_same_bytes(worker, before[worker], TARGET, 7)
    wait_for(lambda: cache(server).l1_pins == 0, what="the retrieves to release every pin")


def test_mla_ranks_share_one_object_read_by_both(
    workers: Callable[..., Worker],
    scheduler: Callable[..., SchedulerAdapter],
    server: ServerProcess,
) -> None:
    rank0 = workers("mla", 2, 0, "mla")
    rank1 = workers("mla", 2, 1, "mla")
    sched = scheduler("mla", 2)
    rank0("fill", seed=5)
    before = [rank0.digests(chunk_blocks(SOURCE, c)) for c in range(4)]
    rank0.store("a", PROMPT[: 4 * CHUNK], SOURCE)  # one rank stores; both read
    sched.maybe_submit_lookup_request("b", token_ids=PROMPT[: 4 * CHUNK])
    wait_for(lambda: sched.check_lookup_result("b") == 4 * CHUNK, what="the lookup")
    assert cache(server).l1_pins == 4 * 2  # 4 shared objects, 2 readers each
    assert rank0.retrieve("b", PROMPT, TARGET, end=4 * CHUNK) == []
    assert cache(server).l1_pins == 4  # rank 0's reads are released, rank 1's pins remain
    assert rank1.retrieve("b", PROMPT, TARGET, end=4 * CHUNK) == []
    assert_same_bytes(rank1, before, TARGET, 4)  # rank 1 got rank 0's bytes
    wait_for(lambda: cache(server).l1_pins == 0, what="both readers to release")


# --------------------------------------------------------------------------- pins and capacity


def test_end_session_releases_every_pin_exactly_once(
    workers: Callable[..., Worker],
    scheduler: Callable[..., SchedulerAdapter],
    server: ServerProcess,
) -> None:
    worker = workers()
    sched = scheduler()
    worker.store("a", PROMPT, SOURCE)
    assert lookup(sched, "b", PROMPT) == 10 * CHUNK
    assert cache(server).l1_pins == 10
    assert lookup(sched, "b", PROMPT) == 10 * CHUNK  # a repeated lookup replaces its pins
    assert cache(server).l1_pins == 10
    sched.free_lookup_locks("b")
    sched.end_session("b")
    sched.end_session("b")
    wait_for(lambda: cache(server).l1_pins == 0, what="the pins to go")
    assert cache(server).requests == 0  # the server keeps no prompts: nothing is left


def test_l1_full_of_pinned_chunks_refuses_stores_and_evicts_nothing(
    server_process: Callable[..., ServerProcess], short_dir: Path
) -> None:
    # 3 chunks of 4 layers × 2 × 256 tokens × 64 × 2 bytes = 256 KiB fit in a 768 KiB L1.
    # --lease-share 1: pins may take all of L1 here (by default they stop at 90%).
    server = server_process("--l1-size", "768KiB", "--lease-share", "1")
    worker = Worker(server.endpoint, "m", 1, 0, "flash_attn", ())
    sched = SchedulerAdapter(server.endpoint, "m", 1, 0, BLOCK)
    try:
        worker.wait_registered()
        worker("fill", seed=4)
        worker.store("a", PROMPT[: 3 * CHUNK], SOURCE)
        assert lookup(sched, "pin-all", PROMPT[: 3 * CHUNK]) == 3 * CHUNK
        other = [11] * (2 * CHUNK)
        worker.store("b", other, SOURCE)
        state = cache(server)
        assert state.store_failures == 2
        assert state.l1_evictions == 0
        assert lookup(sched, "check", PROMPT[: 3 * CHUNK]) == 3 * CHUNK  # nothing pinned lost
        assert lookup(sched, "check-other", other) == 0
        sched.end_session("pin-all")
        sched.end_session("check")
        wait_for(lambda: cache(server).l1_pins == 0, what="the ends to reach the server")
        worker.store("c", other, SOURCE)  # room is made by evicting now-unpinned chunks
        assert lookup(sched, "check-again", other) == 2 * CHUNK
        assert cache(server).l1_evictions == 2
    finally:
        sched.close()
        worker.close()


def test_a_lookup_does_not_wait_for_another_clients_store_in_progress(
    server: ServerProcess,
    workers: Callable[..., Worker],
    scheduler: Callable[..., SchedulerAdapter],
) -> None:
    workers()  # registers the model
    sched = scheduler()
    with Client(server.endpoint) as slow_writer:
        layout = LayoutSpec("flash_attn", 4, 256, 16, 2, 32, "float16")
        slow_writer.request(Register("slow", "m", 1, 0, layout, HASH_SCHEME_TOKENS))
        reply = slow_writer.request(Store("s", 0, 4 * CHUNK, HASHES[:4]))
        assert {slot.status for slot in reply.slots} == {"write"}  # type: ignore[attr-defined]
        # The writer now "copies" (never commits). A lookup meanwhile answers at once, and the
        # reserved chunks are invisible to it.
        started = time.monotonic()
        assert lookup(sched, "l", PROMPT[: 4 * CHUNK]) == 0
        assert time.monotonic() - started < 1.0
        assert cache(server).l1_writing == 4


# --------------------------------------------------------------------------- failures


def test_a_killed_workers_pins_and_registration_are_freed_after_the_heartbeat_timeout(
    server: ServerProcess,
    workers: Callable[..., Worker],
    scheduler: Callable[..., SchedulerAdapter],
) -> None:
    worker = workers()
    sched = scheduler()
    worker.store("a", PROMPT, SOURCE)
    assert lookup(sched, "b", PROMPT) == 10 * CHUNK
    # The worker reserves slots and dies before committing them.
    worker("store", request="c", tokens=[3] * (2 * CHUNK), blocks=SOURCE, end=2 * CHUNK)
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait()
    sched.end_session("b")
    wait_for(lambda: cache(server).registrations == 0, timeout=10, what="the registration to go")
    state = cache(server)
    assert (state.l1_pins, state.l1_writing, state.leases) == (0, 0, 0)
    assert lookup(sched, "d", [3] * (2 * CHUNK)) == 0  # nothing half-written became visible


def test_operations_without_registration_and_incompatible_engines_are_refused(
    server: ServerProcess, workers: Callable[..., Worker]
) -> None:
    workers("m")  # float16 flash_attn, token mode
    with Client(server.endpoint) as client:
        with pytest.raises(NotRegistered, match="register first"):
            client.request(Store("x", 0, CHUNK, HASHES[:1]))
        layout = LayoutSpec("flash_attn", 4, 256, 16, 2, 32, "bfloat16")
        # Another engine of the model with another profile coexists (its own namespace) ...
        client.request(Register("other", "m", 1, 0, layout, HASH_SCHEME_TOKENS))
        # ... but the workers of one engine must agree; the refusal names the field only.
        layout32 = LayoutSpec("flash_attn", 4, 256, 16, 2, 32, "float32")
        with Client(server.endpoint) as second, pytest.raises(Incompatible) as refused:
            second.request(Register("other", "m", 1, 0, layout32, HASH_SCHEME_TOKENS))
        assert "dtype" in str(refused.value)
        assert "bfloat16" not in str(refused.value)
        assert "float32" not in str(refused.value)
        odd = LayoutSpec("flash_attn", 4, 256, 48, 2, 32, "float16")
        with pytest.raises(
            BadRequest, match="block size 48 does not divide the server's chunk size 256"
        ):
            client.request(Register("odd", "odd", 1, 0, odd, HASH_SCHEME_TOKENS))
        reply = client.request(Lookup("r", "unknown-model", 1, HASHES[:1]))
        assert reply == LookupReply(0, 0)


def test_the_engine_keeps_running_through_a_server_restart(
    server: ServerProcess,
    workers: Callable[..., Worker],
    scheduler: Callable[..., SchedulerAdapter],
) -> None:
    worker = workers()
    sched = scheduler()
    worker("fill", seed=9)
    before = [worker.digests(chunk_blocks(SOURCE, c)) for c in range(10)]
    worker.store("a", PROMPT, SOURCE)
    assert lookup(sched, "b", PROMPT) == 10 * CHUNK

    server.kill()
    # While the server is away: prompt answers, failures instead of hangs or exceptions.
    started = time.monotonic()
    assert lookup(sched, "c", PROMPT) == 0
    worker("store", request="d", tokens=PROMPT, blocks=SOURCE, end=len(PROMPT))
    assert worker("wait", request="d", timeout=10)["done"]
    failed = worker.retrieve("e", PROMPT, TARGET, end=10 * CHUNK)
    assert sorted(failed) == sorted(TARGET)
    assert time.monotonic() - started < 10

    server.start()
    worker.wait_registered()  # re-registered by itself
    assert lookup(sched, "f", PROMPT) == 0  # the new server's L1 is empty
    worker.store("g", PROMPT, SOURCE)
    assert lookup(sched, "h", PROMPT) == 10 * CHUNK
    assert worker.retrieve("h", PROMPT, TARGET, end=10 * CHUNK) == []
    assert_same_bytes(worker, before, TARGET, 10)


def test_torch_cpu_tensors_as_the_engine_allocated_them(
    workers: Callable[..., Worker], scheduler: Callable[..., SchedulerAdapter]
) -> None:
    """vLLM's CPU backend allocates plain torch.zeros tensors (bfloat16 here, in its layout)."""
    pytest.importorskip("torch")
    worker = workers("torch-model", 1, 0, "cpu", "--torch")
    sched = scheduler("torch-model")
    worker("fill", seed=12)
    before = [worker.digests(chunk_blocks(SOURCE, c)) for c in range(10)]
    worker.store("a", PROMPT, SOURCE)
    assert lookup(sched, "b", PROMPT) == 10 * CHUNK
    assert worker.retrieve("b", PROMPT, TARGET, end=10 * CHUNK) == []
    assert_same_bytes(worker, before, TARGET, 10)


def test_a_store_in_flight_survives_the_end_of_its_request(
    server: ServerProcess, workers: Callable[..., Worker]
) -> None:
    """Engines save asynchronously: the scheduler may end a request before its worker commits."""
    workers()
    layout = LayoutSpec("flash_attn", 4, 256, 16, 2, 32, "float16")
    with Client(server.endpoint) as writer, Client(server.endpoint) as sched:
        writer.request(Register("w", "m", 1, 0, layout, HASH_SCHEME_TOKENS))
        reply = writer.request(Store("late", 0, 2 * CHUNK, HASHES[:2]))
        assert [slot.status for slot in reply.slots] == ["write", "write"]  # type: ignore[attr-defined]
        sched.request(EndSession("late", "m"))
        committed = writer.request(Commit("late", written=HASHES[:2]))
        assert committed == CommitReply(2, ())
        found = sched.request(Lookup("check", "m", 1, HASHES[:2]))
        assert found == LookupReply(2 * CHUNK, 2)
