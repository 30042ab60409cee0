"""SchedulerAdapter: deferred lookups go out together as one ``lookup_batch``, each request
gets its own answer from it, and an older server without ``lookup_batch`` still answers."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvtrio.client import Client, SchedulerAdapter
from kvtrio.errors import ErrorCode
from kvtrio.launch import ServerProcess
from kvtrio.protocol import (
    MAX_LOOKUP_BATCH,
    PROTOCOL_VERSION,
    EndSession,
    HelloReply,
    Lookup,
    LookupBatch,
    LookupBatchReply,
    LookupFailure,
    LookupReply,
)
from kvtrio.storage import token_chunk_hashes

from .._support.e2e import BLOCK, PROMPT, SERVER_ARGS, SOURCE, Worker
from .._support.waiting import wait_for
from .raw_server import RawServer, Taken, client_of_raw_server

PROMPTS = {"a": list(range(512)), "b": list(range(1000, 1256)), "c": list(range(5))}


def _adapter(client: Client) -> SchedulerAdapter:
    return SchedulerAdapter("", "m", 2, 0, 16, client=client, timeout=5, engine_id="e")


def _defer_all(adapter: SchedulerAdapter) -> None:
    for request_id, tokens in PROMPTS.items():
        adapter.maybe_submit_lookup_request(request_id, token_ids=tokens, defer=True)
        assert adapter.check_lookup_result(request_id) is None  # not sent: no answer yet


def _answered(adapter: SchedulerAdapter, request_id: str) -> int:
    deadline = time.monotonic() + 10
    while (hit := adapter.check_lookup_result(request_id, wait=0.05)) is None:
        assert time.monotonic() < deadline, f"no answer for {request_id}"
    return hit


def _requests(server: RawServer, adapter: SchedulerAdapter, count: int) -> list[Taken]:
    """The next ``count`` requests, looking at every lookup meanwhile (which resends some)."""
    taken: list[Taken] = []
    deadline = time.monotonic() + 10
    while len(taken) < count:
        assert time.monotonic() < deadline, f"{len(taken)} requests of {count} came"
        for request_id in PROMPTS:
            adapter.check_lookup_result(request_id)
        if server.sock.poll(20):
            taken.append(server.take())
    return taken


def test_deferred_lookups_go_out_as_one_batch_at_the_flush(endpoint: str) -> None:
    with client_of_raw_server(endpoint) as (client, server):
        adapter = _adapter(client)
        _defer_all(adapter)
        assert not server.sock.poll(50)  # nothing sent before the flush
        adapter.flush_lookups()
        taken = server.take()
        batch = taken.request
        assert isinstance(batch, LookupBatch)
        assert batch.requests == ("a", "b", "c")
        assert batch.chunk_hashes == tuple(
            tuple(token_chunk_hashes(tokens, 256)) for tokens in PROMPTS.values()
        )
        assert (batch.model, batch.world_size, batch.engine) == ("m", 2, "e")
        failed = (LookupFailure(1, "busy", "too many requests"),)
        server.answer(taken, LookupBatchReply((512, 256, 0), (2, 1, 0), failed))
        assert [_answered(adapter, r) for r in PROMPTS] == [512, 0, 0]


def test_a_burst_beyond_the_batch_bound_goes_as_several_batches(endpoint: str) -> None:
    with client_of_raw_server(endpoint) as (client, server):
        adapter = _adapter(client)
        names = [f"r{i}" for i in range(MAX_LOOKUP_BATCH + 1)]
        for index, request_id in enumerate(names):
            tokens = list(range(index, index + 256))
            adapter.maybe_submit_lookup_request(request_id, token_ids=tokens, defer=True)
        adapter.flush_lookups()
        first, second = server.take(), server.take()
        assert isinstance(first.request, LookupBatch)
        assert first.request.requests == tuple(names[:MAX_LOOKUP_BATCH])
        assert isinstance(second.request, Lookup | LookupBatch)
        size = MAX_LOOKUP_BATCH
        server.answer(first, LookupBatchReply((256,) * size, (1,) * size))
        if isinstance(second.request, LookupBatch):
            assert second.request.requests == (names[-1],)
            server.answer(second, LookupBatchReply((0,), (0,)))
        else:
            server.answer(second, LookupReply(0, 0))
        assert _answered(adapter, names[0]) == 256
        assert _answered(adapter, names[-2]) == 256
        assert _answered(adapter, names[-1]) == 0


def test_waiting_for_a_deferred_lookup_sends_the_queue(endpoint: str) -> None:
    with client_of_raw_server(endpoint) as (client, server):
        adapter = _adapter(client)
        adapter.maybe_submit_lookup_request("a", token_ids=PROMPTS["a"], defer=True)
        adapter.maybe_submit_lookup_request("b", token_ids=PROMPTS["b"], defer=True)
        assert adapter.check_lookup_result("b", wait=0.01) is None  # sent, not answered
        taken = server.take()
        assert isinstance(taken.request, LookupBatch)
        assert taken.request.requests == ("a", "b")
        server.answer(taken, LookupBatchReply((512, 256), (2, 1)))
        assert _answered(adapter, "b") == 256
        assert _answered(adapter, "a") == 512


def test_one_deferred_lookup_goes_alone_and_ended_ones_not_at_all(endpoint: str) -> None:
    with client_of_raw_server(endpoint) as (client, server):
        adapter = _adapter(client)
        _defer_all(adapter)
        adapter.end_session("a")  # finished before the flush: its lookup is dropped, and
        adapter.end_session("b")  # the server holds nothing for them: no end message
        adapter.flush_lookups()
        taken = server.take()
        assert isinstance(taken.request, Lookup)
        assert taken.request.request == "c"
        server.answer(taken, LookupReply(0, 0))
        assert _answered(adapter, "c") == 0


def test_a_request_ends_with_a_message_only_if_the_server_may_hold_something_for_it(
    endpoint: str,
) -> None:
    """Issue 33: an end message per request costs the scheduler's thread ~0.6 ms on a busy
    engine; a request whose one lookup missed, or whose pins were freed once it was answered,
    holds nothing at the server. Every other case still ends with one."""
    with client_of_raw_server(endpoint) as (client, server):
        adapter = _adapter(client)
        tokens = PROMPTS["a"]

        def looked_up(request_id: str, hit: int) -> None:
            adapter.maybe_submit_lookup_request(request_id, token_ids=tokens)
            server.answer(server.take(), LookupReply(hit, hit // 256))
            assert _answered(adapter, request_id) == hit

        looked_up("miss", 0)
        looked_up("hit", 512)
        looked_up("freed", 512)
        adapter.cleanup_lookup_result("freed")  # (as the connector does once it allocated)
        adapter.free_lookup_locks("freed")
        assert server.take().op == "free_lookup_locks"
        adapter.maybe_submit_lookup_request("unanswered", token_ids=tokens)
        unanswered = server.take()
        adapter.maybe_submit_lookup_request("refused", token_ids=tokens)
        server.refuse(server.take(), ErrorCode.BUSY, "too many requests")
        assert _answered(adapter, "refused") == 0  # a failure: what the server did is unknown
        looked_up("twice", 512)  # asked again (a hybrid model's groups): the first may
        adapter.cleanup_lookup_result("twice")  # still pin as it ends on the server
        looked_up("twice", 0)
        for request_id in ("miss", "hit", "freed", "unanswered", "refused", "twice", "never"):
            adapter.end_session(request_id)
        ended = [server.take().request for _ in range(4)]
        assert all(isinstance(end, EndSession) for end in ended)
        assert [end.request for end in ended] == ["hit", "unanswered", "refused", "twice"]
        server.answer(unanswered, LookupReply(0, 0))
        adapter.maybe_submit_lookup_request("next", token_ids=tokens)  # nothing else came
        assert server.take().request == Lookup("next", "m", 2, unanswered.request.chunk_hashes,
                                               engine="e")  # fmt: skip


def test_a_server_without_lookup_batch_gets_single_lookups(endpoint: str) -> None:
    with client_of_raw_server(endpoint) as (client, server):
        adapter = _adapter(client)
        _defer_all(adapter)
        adapter.flush_lookups()
        taken = server.take()
        assert taken.op == "lookup_batch"
        server.refuse(taken, ErrorCode.UNKNOWN_OPERATION, "unknown operation 'lookup_batch'")
        hits = {"a": 512, "b": 256, "c": 0}
        for single in _requests(server, adapter, 3):  # each resent alone once looked at
            request = single.request
            assert isinstance(request, Lookup)
            server.answer(single, LookupReply(hits[request.request], hits[request.request] // 256))
        assert {r: _answered(adapter, r) for r in PROMPTS} == hits
        adapter.maybe_submit_lookup_request("d", token_ids=PROMPTS["a"], defer=True)
        adapter.maybe_submit_lookup_request("e", token_ids=PROMPTS["b"], defer=True)
        adapter.flush_lookups()
        assert [server.take().op for _ in range(2)] == ["lookup", "lookup"]  # no more batches


def test_lookups_are_cut_to_the_servers_bounds_of_one_message() -> None:
    """Issue 22: the server refuses a lookup of more than MAX_LOOKUP_KEYS keys (world size ×
    hashes, summed over a batch); the adapter looks up a shorter prefix and cuts batches."""
    from kvtrio.client._scheduler import _batches, _Queued, lookup_limit
    from kvtrio.protocol import MAX_HASHES, MAX_LOOKUP_BATCH, MAX_LOOKUP_KEYS, PromptChunks

    assert lookup_limit(1) == MAX_HASHES
    assert lookup_limit(16) == MAX_LOOKUP_KEYS // 16
    assert lookup_limit(256) == MAX_LOOKUP_KEYS // 256
    hashes = (bytes(16),) * (lookup_limit(16) // 2)
    queue = [(f"r{i}", _Queued(PromptChunks(hashes, 256, 16))) for i in range(5)]
    cut = _batches(queue, 16)
    assert [len(batch) for batch in cut] == [2, 2, 1]  # 2,048 × 16 = 32,768 keys each
    small = [(f"r{i}", _Queued(PromptChunks((), 256, 16))) for i in range(MAX_LOOKUP_BATCH + 1)]
    assert [len(batch) for batch in _batches(small, 1)] == [MAX_LOOKUP_BATCH, 1]


# --------------------------------------------------------------------------- before the hello
# Issue 32: an adapter used as soon as it is made answered its first lookups 0 while its
# connection's hello was on its way, though the server was up and held the prompt.


def test_a_lookup_made_at_once_is_a_full_hit_of_a_stored_prompt(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process(*SERVER_ARGS)
    worker = Worker(server.endpoint, "m", 1, 0, "flash_attn", ())
    try:
        worker.wait_registered()
        worker.store("first", PROMPT, SOURCE)
        adapter = SchedulerAdapter(server.endpoint, "m", 1, 0, BLOCK, timeout=30)
        try:
            # Used at once: usually before the hello's answer (on main this lookup answered 0;
            # the raw-server test below holds the answer back to make it certain).
            adapter.maybe_submit_lookup_request("second", token_ids=PROMPT)
            assert adapter.check_lookup_result("second", wait=30) == len(PROMPT)
        finally:
            adapter.close()
    finally:
        worker.close()


def test_a_lookup_waits_for_the_hello_and_goes_out_after_it(endpoint: str) -> None:
    server = RawServer(endpoint)
    try:
        adapter = SchedulerAdapter(endpoint, "m", 1, 0, 16, timeout=30, engine_id="e")
        try:
            adapter.maybe_submit_lookup_request("a", token_ids=PROMPTS["a"])
            hello = server.take()
            assert hello.op == "hello"
            assert adapter.check_lookup_result("a") is None  # waiting, not a miss
            assert not server.sock.poll(50)  # nothing sent before the hello's answer
            server.answer(hello, HelloReply("raw", PROTOCOL_VERSION, "raw", 256, 60.0, 1 << 20))
            # Sent at the first look after the answer came (the look itself receives it).
            (lookup,) = _requests(server, adapter, 1)
            assert isinstance(lookup.request, Lookup)
            assert lookup.request.chunk_hashes == tuple(token_chunk_hashes(PROMPTS["a"], 256))
            server.answer(lookup, LookupReply(512, 2))
            assert _answered(adapter, "a") == 512
        finally:
            adapter.close()
    finally:
        server.close()


def test_a_hello_never_answered_is_a_miss_at_the_lookups_timeout(endpoint: str) -> None:
    server = RawServer(endpoint)
    try:
        adapter = SchedulerAdapter(endpoint, "m", 1, 0, 16, timeout=0.5)
        try:
            adapter.maybe_submit_lookup_request("a", token_ids=PROMPTS["a"], defer=True)
            assert server.take().op == "hello"  # connected; the hello is never answered
            started = time.monotonic()
            assert adapter.check_lookup_result("a", wait=30) == 0
            assert time.monotonic() - started < 5  # its own timeout, not the wait
        finally:
            adapter.close()
    finally:
        server.close()


def test_lookups_fail_fast_while_no_server_listens(short_dir: Path) -> None:
    adapter = SchedulerAdapter(f"ipc://{short_dir}/none.sock", "m", 1, 0, 16, timeout=30)
    try:
        started = time.monotonic()
        adapter.maybe_submit_lookup_request("a", token_ids=PROMPTS["a"])
        assert adapter.check_lookup_result("a", wait=30) == 0
        assert time.monotonic() - started < 5  # the server is known away: no wait
        wait_for(adapter.client.known_away, what="the refused connection")
        adapter.maybe_submit_lookup_request("b", token_ids=PROMPTS["b"])
        assert adapter.check_lookup_result("b") == 0  # at once
    finally:
        adapter.close()


# --------------------------------------------------------------------------- the hit's tiers
# Issue 33: the load policy judges a hit's L1 part apart from the part the server's L2 must
# load first; a server older than the reply's ``l1_chunks`` says nothing (all counts as L1).


def test_the_hits_l1_part_is_kept_for_the_load_policy(endpoint: str) -> None:
    with client_of_raw_server(endpoint) as (client, server):
        adapter = _adapter(client)
        _defer_all(adapter)
        assert adapter.lookup_l1_tokens("a") is None  # not answered yet
        adapter.flush_lookups()
        taken = server.take()
        server.answer(taken, LookupBatchReply((512, 256, 0), (2, 1, 0), l1_chunks=(1, 0, 0)))
        assert [_answered(adapter, r) for r in PROMPTS] == [512, 256, 0]
        assert [adapter.lookup_l1_tokens(r) for r in PROMPTS] == [256, 0, 0]
        adapter.cleanup_lookup_result("a")
        assert adapter.lookup_l1_tokens("a") is None
        # Alone, and from an older server (no l1_chunks: the whole hit counts as in L1).
        adapter.maybe_submit_lookup_request("d", token_ids=PROMPTS["a"])
        server.answer(server.take(), LookupReply(512, 2, l1_chunks=0))
        assert _answered(adapter, "d") == 512
        assert adapter.lookup_l1_tokens("d") == 0
        adapter.maybe_submit_lookup_request("e", token_ids=PROMPTS["a"])
        server.answer(server.take(), LookupReply(512, 2))
        assert _answered(adapter, "e") == 512
        assert adapter.lookup_l1_tokens("e") == 512
        adapter.maybe_submit_lookup_request("f", token_ids=PROMPTS["a"], defer=True)
        adapter.maybe_submit_lookup_request("g", token_ids=PROMPTS["b"], defer=True)
        adapter.flush_lookups()
        server.answer(server.take(), LookupBatchReply((512, 256), (2, 1)))
        assert (_answered(adapter, "f"), adapter.lookup_l1_tokens("f")) == (512, 512)
