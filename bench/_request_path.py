"""The request-path rows of ``bench/protocol.py`` (issue 13): what an engine's scheduler sees.

Each function measures against a running ``kvtrio serve`` with a connected sync client:

* ``ping``: ``Client.request(Ping())`` round trips, with the CPU per ping of the client's and
  the server's process; the same from a raw pyzmq DEALER (:func:`raw_ping`): put against a
  kvtrio server and against a raw ROUTER answering kvtrio's reply bytes, they split the round
  trip into the server's share and the client's;
* lookup → result through :class:`SchedulerAdapter` (1-chunk and 128-chunk prompts), with a
  blocking caller (``check_lookup_result(wait=…)``) and with a spinning caller (the thread holds
  the GIL in a busy loop of ``check_lookup_result()``, like vLLM's scheduler);
* lookups/s with 64 in flight;
* a burst of 64 new requests the way ``KvtrioConnector`` takes them (deferred lookups, at most
  one wait per scheduler step, the rest sent as one ``lookup_batch`` at the end of the step and
  collected at the next one): the scheduler's time in total, engine steps in between not
  counted.
"""

from __future__ import annotations

import collections
import itertools
import os
import statistics
import time

import zmq

from kvtrio.client import Client, SchedulerAdapter
from kvtrio.protocol import EndSession, Lookup, Ping, encode_request
from kvtrio.storage.keys import token_chunk_hashes

WINDOW = 64
BURST = 64
_ids = itertools.count()


def _percentiles(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    return samples[len(samples) // 2], samples[int(len(samples) * 0.99)]


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, all its threads."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_quiet(pid: int, *, timeout: float = 60.0) -> None:
    """Wait until process ``pid`` stops using CPU (a server preallocating its L1, importing):
    measurements taken meanwhile would share the 2 cores with its start-up."""
    deadline = time.monotonic() + timeout
    used = process_cpu(pid)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = process_cpu(pid)
        if now - used < 0.01:
            return
        used = now


def ping(client: Client, n: int, server_pid: int) -> dict[str, float]:
    """p50 seconds of a ping round trip, and CPU seconds per ping of this process (the client,
    libzmq's thread included) and of the server."""
    for _ in range(100):
        client.request(Ping())
    samples = []
    cpu, server_cpu = time.process_time(), process_cpu(server_pid)
    for _ in range(n):
        start = time.perf_counter()
        client.request(Ping())
        samples.append(time.perf_counter() - start)
    return {
        "ping": _percentiles(samples)[0],
        "ping_client_cpu": (time.process_time() - cpu) / n,
        "ping_server_cpu": (process_cpu(server_pid) - server_cpu) / n,
    }


def raw_ping(endpoint: str, n: int, server_pid: int) -> dict[str, float]:
    """:func:`ping` from a raw pyzmq DEALER: kvtrio's ping bytes, blocking receives."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    recv = sock.recv_multipart
    frames = [encode_request(i, Ping()) for i in range(n + 100)]
    for request in frames[:100]:
        sock.send_multipart(request)
        recv()
    samples = []
    cpu, server_cpu = time.process_time(), process_cpu(server_pid)
    for request in frames[100:]:
        start = time.perf_counter()
        sock.send_multipart(request)
        recv()
        samples.append(time.perf_counter() - start)
    result = {
        "ping": _percentiles(samples)[0],
        "ping_client_cpu": (time.process_time() - cpu) / n,
        "ping_server_cpu": (process_cpu(server_pid) - server_cpu) / n,
    }
    sock.close(linger=0)
    return result


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


def hashing(chunks: int, chunk_size: int) -> float:
    """p50 seconds the client spends hashing a ``chunks``-chunk prompt's tokens into its chunk
    hashes (part of :func:`lookup`'s time)."""
    tokens = _prompt(chunks, chunk_size)
    samples = []
    for _ in range(max(20, 2000 // chunks)):
        start = time.perf_counter()
        token_chunk_hashes(tokens, chunk_size)
        samples.append(time.perf_counter() - start)
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
    """Median scheduler seconds (all steps together) to get the lookups of 64 new requests,
    the way ``KvtrioConnector.get_num_new_matched_tokens`` and ``build_connector_meta`` take
    them: lookups deferred, at most one wait per step (which sends what is queued), the rest
    sent as one ``lookup_batch`` at the end of the step and collected at the next."""
    tokens = _prompt(1, adapter.chunk_size)
    # An older adapter (--baseline runs of this script) sends each lookup at once.
    batches = hasattr(adapter, "flush_lookups")
    options = {"defer": True} if batches else {}
    totals = []
    for _ in range(rounds):
        rids = [f"s{next(_ids)}" for _ in range(BURST)]
        pending = set(rids)
        spent = 0.0
        while pending:
            start = time.perf_counter()
            waited = False
            for rid in rids:
                if rid not in pending:
                    continue
                adapter.maybe_submit_lookup_request(rid, token_ids=tokens, **options)
                hit = adapter.check_lookup_result(rid)
                if hit is None and not waited:
                    waited = True
                    hit = adapter.check_lookup_result(rid, wait=0.02)
                if hit is not None:
                    pending.discard(rid)
            if batches:
                adapter.flush_lookups()  # build_connector_meta: the step's deferred lookups
            spent += time.perf_counter() - start
            if pending:  # the engine's forward pass: the replies arrive meanwhile
                time.sleep(0.005)
        totals.append(spent)
        for rid in rids:
            adapter.end_session(rid)
        adapter.client.request(Ping())  # (in order: the server is done with the ends)
    return statistics.median(totals)
