"""The offline eviction evaluator: replay a workload's chunk keys through the real L1 index and
policy classes, without a server, and report the hit ratio by capacity.

Conventions (those of issue 16's table): requests are replayed one at a time; capacity counts
chunks; a request's hits are its leading chunks present in the cache, counted over its *full*
chunks; then every chunk of its prompt (the last, partial one of a trace request included) is
stored, or touched if present, in reversed prompt order (``order="reversed"``); or, as the
server does (``order="server"``), only the full chunks, in prompt order, all of a store's slots
reserved before any is committed, with the request's hits pinned meanwhile. The hit ratio is
hit chunks over full chunks.

Beside the policies: plain LFU (frequencies kept across evictions, ties to the least recent) and
the offline optimum (Belady: evict the chunk whose next use in the reversed-order access stream
is furthest away) computed from the same requests.
"""

from __future__ import annotations

import heapq
import json
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
from rich.console import Console

from ..protocol import DEFAULT_CHUNK_SIZE
from ..storage import EVICTION_POLICIES, Entry, EvictionPolicy, L1Cache
from ._options import BenchError, BenchOptions
from ._workload import TRACE_BLOCK_TOKENS, ChatWorkload

__all__ = [
    "SimRequest",
    "chat_requests",
    "evaluate",
    "format_table",
    "reuse_distances",
    "simulate_hinted_lru",
    "simulate_lfu",
    "simulate_main",
    "simulate_optimum",
    "simulate_policy",
    "trace_requests",
]

INF = float("inf")


@attrs.frozen
class SimRequest:
    """The chunk keys of one prompt (prefix-chained) and how many of them are full chunks."""

    keys: tuple[bytes, ...]
    full: int


def trace_requests(path: Path, limit: int = 0) -> list[SimRequest]:
    """A Mooncake trace's requests: one chunk per ``hash_ids`` entry (512 tokens)."""
    out = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if not line.strip():
                continue
            row = json.loads(line)
            ids = row["hash_ids"]
            full = min(row["input_length"] // TRACE_BLOCK_TOKENS, len(ids))
            out.append(SimRequest(tuple(i.to_bytes(8, "little") for i in ids), full))
            if limit and len(out) >= limit:
                break
    return out


def chat_requests(
    options: BenchOptions, chunk_size: int = DEFAULT_CHUNK_SIZE, interleave: int = 1
) -> list[SimRequest]:
    """The built-in chat workload's requests as chunks of ``chunk_size`` tokens; ``interleave``
    conversations at a time take turns (as with the bench's ``--concurrency``)."""
    workload = ChatWorkload(options)
    per = chunk_size // workload.block_size
    order = sorted(
        range(len(workload.requests)),
        key=lambda i: (
            workload.requests[i].conversation // interleave,
            workload.requests[i].turn,
            workload.requests[i].conversation,
        ),
    )
    out = []
    for index in order:
        blocks = workload.identities(index)
        keys = tuple(
            int(blocks[(c + 1) * per - 1]).to_bytes(8, "little") for c in range(len(blocks) // per)
        )
        out.append(SimRequest(keys, len(keys)))
    return out


def simulate_policy(
    requests: Iterable[SimRequest],
    capacity: int,
    factory: Callable[[], EvictionPolicy],
    order: str = "reversed",
    start: int = 0,
) -> float:
    """Hit ratio of an L1 of ``capacity`` chunks (0: unbounded) with the factory's policy,
    over the requests from index ``start`` on (those before only warm the cache: the held-out
    half of a trace is measured with the first half as warm-up)."""
    if order not in ("reversed", "server"):
        raise ValueError(f"order must be 'reversed' or 'server', got {order!r}")
    size = capacity or 1 << 62
    l1 = L1Cache(size, policy=factory(), alignment=1)
    hits = total = 0
    for number, request in enumerate(requests):
        keys = request.keys
        hit = l1.prefix(keys[: request.full])
        if number >= start:
            hits += hit
            total += request.full
        if order == "reversed":
            for index in range(len(keys) - 1, -1, -1):
                _store(l1, keys[index], keys[index - 1] if index else None)
        else:  # as the server: full chunks only, all reserved before any is committed
            for key in keys[:hit]:
                l1.pin(key)
            written = [
                key
                for index, key in enumerate(keys[hit : request.full], start=hit)
                if isinstance(l1.reserve(key, 1, parent=keys[index - 1] if index else None), Entry)
            ]
            for key in written:
                l1.commit(key)
            for key in keys[:hit]:
                l1.unpin(key)
    return hits / total if total else 0.0


def _store(l1: L1Cache, key: bytes, parent: bytes | None) -> None:
    if isinstance(l1.reserve(key, 1, parent=parent), Entry):
        l1.commit(key)


def simulate_lfu(requests: Sequence[SimRequest], capacity: int, start: int = 0) -> float:
    """Plain LFU: each request counts once for each of its chunks, counts survive eviction,
    ties go to the least recently used. A reference, not a policy (its counts never shrink)."""
    freq: dict[bytes, int] = defaultdict(int)
    cache: dict[bytes, tuple[int, int]] = {}
    heap: list[tuple[int, int, bytes]] = []
    hits = total = clock = 0
    for number, request in enumerate(requests):
        if number >= start:
            hits += _prefix_hits(cache, request)
            total += request.full
        for key in reversed(request.keys):
            clock += 1
            freq[key] += 1
            cache[key] = (freq[key], clock)
            heapq.heappush(heap, (freq[key], clock, key))
            _shrink(cache, heap, capacity)
    return hits / total if total else 0.0


def simulate_optimum(requests: Sequence[SimRequest], capacity: int, start: int = 0) -> float:
    """Belady's offline optimum over the reversed-order access stream of all chunks, counted
    from request ``start`` on."""
    stream = [key for request in requests for key in reversed(request.keys)]
    next_use = [0] * len(stream)
    seen: dict[bytes, int] = {}
    for position in range(len(stream) - 1, -1, -1):
        next_use[position] = seen.get(stream[position], len(stream))
        seen[stream[position]] = position
    cache: dict[bytes, tuple[int, int]] = {}
    heap: list[tuple[int, int, bytes]] = []
    hits = total = position = 0
    for number, request in enumerate(requests):
        if number >= start:
            hits += _prefix_hits(cache, request)
            total += request.full
        for key in reversed(request.keys):
            priority = (-next_use[position], position)
            cache[key] = priority
            heapq.heappush(heap, (*priority, key))
            position += 1
            _shrink(cache, heap, capacity)
    return hits / total if total else 0.0


def simulate_hinted_lru(requests: Sequence[SimRequest], capacity: int) -> float:
    """LRU told, for each chunk it stores, whether any later request asks for it again (an
    oracle *hint*, not a time): chunks never asked again are not kept. What a perfect "this
    prompt will (not) be continued" hint from the engine would be worth."""
    last: dict[bytes, int] = {}
    for index, request in enumerate(requests):
        for key in request.keys:
            last[key] = index
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = total = 0
    for index, request in enumerate(requests):
        hit = 0
        while hit < request.full and request.keys[hit] in cache:
            hit += 1
        hits, total = hits + hit, total + request.full
        for key in reversed(request.keys):
            if last[key] <= index:
                cache.pop(key, None)
                continue
            cache[key] = None
            cache.move_to_end(key)
            if capacity and len(cache) > capacity:
                cache.popitem(last=False)
    return hits / total if total else 0.0


def reuse_distances(requests: Sequence[SimRequest]) -> list[int]:
    """For every prefix hit of an unbounded cache: chunks stored since that chunk's last use
    (a chunk can only hit in an LRU cache at least that large). Sorted."""
    stored = 0
    last: dict[bytes, int] = {}
    out = []
    for request in requests:
        for key in request.keys[: request.full]:
            if key not in last:
                break
            out.append(stored - last[key])
        for key in request.keys:
            last[key] = stored
        stored += len(request.keys)
    return sorted(out)


def _prefix_hits(cache: dict[bytes, tuple[int, int]], request: SimRequest) -> int:
    count = 0
    for key in request.keys[: request.full]:
        if key not in cache:
            break
        count += 1
    return count


def _shrink(
    cache: dict[bytes, tuple[int, int]], heap: list[tuple[int, int, bytes]], capacity: int
) -> None:
    """Pop the lowest-priority live entries until ``cache`` fits (stale heap items skipped)."""
    while capacity and len(cache) > capacity:
        first, second, key = heapq.heappop(heap)
        if cache.get(key) == (first, second):
            del cache[key]


@attrs.frozen
class Row:
    capacity: int
    ratios: dict[str, float]


def evaluate(
    requests: Sequence[SimRequest],
    capacities: Sequence[int],
    policies: Sequence[str] = tuple(EVICTION_POLICIES),
    order: str = "reversed",
    references: bool = True,
    start: int = 0,
) -> tuple[list[Row], float]:
    """Hit ratio per capacity for each named policy, LFU and the optimum, over the requests
    from ``start`` on (those before warm the cache); and seconds taken."""
    started = time.perf_counter()
    rows = []
    for capacity in capacities:
        ratios = {
            name: simulate_policy(requests, capacity, EVICTION_POLICIES[name], order, start)
            for name in policies
        }
        if references:
            ratios["LFU"] = simulate_lfu(requests, capacity, start)
            ratios["optimum"] = simulate_optimum(requests, capacity, start)
        rows.append(Row(capacity, ratios))
    return rows, time.perf_counter() - started


def format_table(rows: Sequence[Row], baseline: str = "lru") -> str:
    """A Markdown table: one row per capacity, hit ratios, and each policy's ratio to LRU."""
    names = list(rows[0].ratios)
    lines = [
        "| capacity (chunks) | " + " | ".join(names) + " |",
        "| --- " * (len(names) + 1) + "|",
    ]
    for row in rows:
        base = row.ratios.get(baseline, 0.0)
        cells = []
        for name in names:
            value = row.ratios[name]
            ratio = f" ({value / base:.2f}×)" if base and name != baseline else ""
            cells.append(f"{value:.3f}{ratio}")
        label = f"{row.capacity:,}" if row.capacity else "unbounded"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def simulate_main(options: BenchOptions, console: Console) -> int:
    """``kvtrio bench --simulate``: the table for the options' workload (a trace's 512-token
    blocks are its chunks; the chat workload is cut into ``--chunk-size`` chunks, with
    ``--concurrency`` conversations taking turns)."""
    options.check()
    try:
        capacities = [int(c) for c in options.capacities.split(",")]
        if options.trace is not None:
            requests = trace_requests(options.trace, options.limit)
            what = f"{options.trace.name}, chunks of {TRACE_BLOCK_TOKENS} tokens"
        else:
            requests = chat_requests(options, options.chunk_size, options.concurrency)
            what = f"chat workload, chunks of {options.chunk_size} tokens"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"cannot simulate: {exc}") from None
    chunks = sum(len(r.keys) for r in requests)
    start = len(requests) // 2 if options.held_out else 0
    counted = f", hits counted from request {start} (held-out half)" if start else ""
    console.print(
        f"eviction evaluator: {len(requests)} requests of {what} ({chunks:,} chunks), "
        f"order {options.sim_order}{counted}; hit ratio (chunks) by L1 capacity in chunks",
        highlight=False,
    )
    rows, seconds = evaluate(requests, capacities, order=options.sim_order, start=start)
    console.print(format_table(rows), highlight=False, markup=False, soft_wrap=True)
    console.print(f"({seconds:.1f} s)", highlight=False)
    return 0
