"""The request-path rows of ``bench/protocol.py`` (issue 13): what an engine's scheduler sees.

Each function measures against a running ``kvtrio serve`` with a connected sync client:

* ``ping``: ``Client.request(Ping())`` round trips;
* lookup → result through :class:`SchedulerAdapter` (1-chunk and 128-chunk prompts), with a
  blocking caller (``check_lookup_result(wait=…)``) and with a spinning caller (the thread holds
  the GIL in a busy loop of ``check_lookup_result()``, like vLLM's scheduler);
* lookups/s with 64 in flight;
* a burst of 64 new requests the way ``KvtrioConnector.get_num_new_matched_tokens`` takes them
  (submit, at most one wait per scheduler step, the rest collected at the next step): the
  scheduler's time in total, engine steps in between not counted.
"""

from __future__ import annotations

import collections
import itertools
import statistics
import time

from kvtrio.client import Client, SchedulerAdapter
from kvtrio.protocol import EndSession, Lookup, Ping
from kvtrio.storage.keys import token_chunk_hashes

WINDOW = 64
BURST = 64
_ids = itertools.count()


def _percentiles(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    return samples[len(samples) // 2], samples[int(len(samples) * 0.99)]


def ping(client: Client, n: int) -> float:
    """p50 seconds of a ping round trip."""
    for _ in range(100):
        client.request(Ping())
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        client.request(Ping())
        samples.append(time.perf_counter() - start)
    return _percentiles(samples)[0]


def _prompt(chunks: int, chunk_size: int) -> list[int]:
    return [7 + i % 30_000 for i in range(chunks * chunk_size)]


def lookup(adapter: SchedulerAdapter, chunks: int, n: int, *, spin: bool) -> float:
    """p50 seconds from submitting a lookup to holding its result."""
    tokens = _prompt(chunks, adapter.chunk_size)
    samples = []
    for i in range(n + 50):
        rid = f"b{next(_ids)}"
        start = time.perf_counter()
        adapter.maybe_submit_lookup_request(rid, token_ids=tokens)
        if spin:
            while adapter.check_lookup_result(rid) is None:
                pass
        else:
            assert adapter.check_lookup_result(rid, wait=10.0) is not None
        if i >= 50:
            samples.append(time.perf_counter() - start)
        adapter.end_session(rid)
    return _percentiles(samples)[0]


def lookups_per_second(client: Client, model: str, n: int) -> float:
    """Lookups (1 chunk) answered per second with 64 in flight (sessions ended afterwards)."""
    hashes = tuple(token_chunk_hashes(_prompt(1, 256), 256))
    in_flight: collections.deque[object] = collections.deque()
    names = [f"w{next(_ids)}" for _ in range(n)]
    start = time.perf_counter()
    for name in names:
        if len(in_flight) >= WINDOW:
            in_flight.popleft().result()  # type: ignore[attr-defined]
        in_flight.append(
            client.submit(Lookup(request=name, model=model, world_size=1, chunk_hashes=hashes))
        )
    while in_flight:
        in_flight.popleft().result()  # type: ignore[attr-defined]
    rate = n / (time.perf_counter() - start)
    ends = [client.submit(EndSession(name, model)) for name in names]
    for end in ends:
        end.result()
    return rate


def burst(adapter: SchedulerAdapter, rounds: int) -> float:
    """Median scheduler seconds (all steps together) to get the lookups of 64 new requests."""
    tokens = _prompt(1, adapter.chunk_size)
    totals = []
    for _ in range(rounds):
        rids = [f"s{next(_ids)}" for _ in range(BURST)]
        pending = set(rids)
        spent = 0.0
        while pending:
            start = time.perf_counter()
            waited = False  # what KvtrioConnector.get_num_new_matched_tokens does per step
            for rid in rids:
                if rid not in pending:
                    continue
                adapter.maybe_submit_lookup_request(rid, token_ids=tokens)
                hit = adapter.check_lookup_result(rid)
                if hit is None and not waited:
                    waited = True
                    hit = adapter.check_lookup_result(rid, wait=0.02)
                if hit is not None:
                    pending.discard(rid)
            spent += time.perf_counter() - start
            if pending:  # the engine's forward pass: the replies arrive meanwhile
                time.sleep(0.005)
        totals.append(spent)
        for rid in rids:
            adapter.end_session(rid)
    return statistics.median(totals)
