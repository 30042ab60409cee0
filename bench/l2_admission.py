"""L2 admission: L2 writes and L2 hits with ``--l2-admission all`` and ``reuse``, side by side.

    python bench/l2_admission.py [--trace FILE] [--capacities 500,2000] [--limit N]

Replays three workloads one request at a time through the real L1 index (``arc``, as the
server's default) and the server's own admission code (``kvtrio.server.l2tier.Admission``),
as the server drives them: a lookup pins the L1 prefix and hands it to admission as used
(a refused chunk is written then), counts the rest of its chunks (once per request), takes the
L2 prefix after it (loaded into L1), and the request stores the chunks after that, each
committed one written to L2 if admission admits it. L2 is unbounded unless ``--l2-capacity``
(chunks, LRU). Capacities count chunks. Workloads:

- **no reuse**: ``--random`` prompts of 16 chunks, no two sharing a chunk (vLLM's ``random``);
- **chat**: the built-in multi-turn chat workload (``kvtrio bench``'s: conversations over
  shared system prompts, each turn's prompt the previous one plus an answer and a question),
  64 conversations taking turns at a time;
- **trace**: the Mooncake trace (its 512-token blocks are the chunks).

Prints, per workload and L1 capacity: L2 writes and L2 hits (chunks) for each mode, and the
ratio reuse/all; then the admission's own cost per key.
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from collections.abc import Sequence
from pathlib import Path

from kvtrio.benchmark._options import BenchOptions
from kvtrio.benchmark._simulate import SimRequest, chat_requests, trace_requests
from kvtrio.server.l2tier import Admission
from kvtrio.storage import Entry, L1Cache, make_policy

TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")


def random_requests(count: int, chunks: int = 16) -> list[SimRequest]:
    """Prompts that share nothing: every chunk key is new."""
    return [SimRequest(tuple(os.urandom(32) for _ in range(chunks)), chunks) for _ in range(count)]


def replay(
    requests: Sequence[SimRequest], mode: str, l1_chunks: int, l2_chunks: int = 0
) -> tuple[int, int, int]:
    """(L2 writes, L2 hit chunks, chunks looked up) of ``requests`` with admission ``mode``."""
    l1 = L1Cache(l1_chunks, policy=make_policy("arc"), alignment=1)
    l2: collections.OrderedDict[bytes, None] = collections.OrderedDict()
    admission = Admission[None](mode)
    writes = l2_hits = total = 0

    def write(key: bytes) -> None:
        nonlocal writes
        if l1.get(key) is None:  # (evicted before its write: as the write-behind, nothing)
            return
        writes += 1
        l2[key] = None
        l2.move_to_end(key)
        if l2_chunks and len(l2) > l2_chunks:
            l2.popitem(last=False)

    for number, request in enumerate(requests):
        keys = request.keys[: request.full]
        total += len(keys)
        hit = l1.prefix(keys)
        for key in keys[:hit]:
            l1.pin(key)
        for key, _ in admission.used(keys[:hit]):  # (the lookup's L1 hits: WriteBehind.rewrite)
            write(key)
        if admission.first_lookup(number):
            admission.count(keys[hit:])
        found = 0
        while hit + found < len(keys) and keys[hit + found] in l2:
            l2.move_to_end(keys[hit + found])
            found += 1
        l2_hits += found
        pinned = list(keys[:hit])
        for index in range(hit, len(keys)):
            key, parent = keys[index], keys[index - 1] if index else None
            outcome = l1.reserve(key, 1, parent=parent)
            if not isinstance(outcome, Entry):
                if l1.get(key) is not None:  # present: a store found it in L1
                    for again, _ in admission.used([key]):
                        write(again)
                continue
            l1.commit(key)
            if index < hit + found:  # loaded from L2: committed, not written
                l1.pin(key)
                pinned.append(key)
                continue
            if admission.commit(key, parent, None):
                write(key)
            for older, _ in admission.backlog():  # (as WriteBehind.commit)
                write(older)
        for key in pinned:
            l1.unpin(key)
    return writes, l2_hits, total


def cost_per_key() -> tuple[float, float]:
    """µs per key counted (a lookup's misses) and per commit decided, with ``reuse``."""
    admission = Admission[None]("reuse")
    keys = [os.urandom(32) for _ in range(100_000)]
    started = time.perf_counter()
    admission.count(keys)
    counted = time.perf_counter() - started
    started = time.perf_counter()
    for index, key in enumerate(keys):
        admission.commit(key, keys[index - 1] if index else None, None)
    committed = time.perf_counter() - started
    return counted / len(keys) * 1e6, committed / len(keys) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, default=0, help="trace: first N requests only")
    parser.add_argument("--random", type=int, default=2000, help="no-reuse prompts")
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--capacities", default="500,2000,8000", help="L1 sizes, in chunks")
    parser.add_argument("--l2-capacity", type=int, default=0, help="chunks (0: unbounded)")
    args = parser.parse_args()
    chat = BenchOptions(conversations=args.conversations, system_prompts=8, turns=args.turns)
    workloads = {
        f"no reuse ({args.random} random prompts × 16 chunks)": random_requests(args.random),
        f"chat ({args.conversations} conversations × {args.turns} turns, 64 at a time)": (
            chat_requests(chat, 256, 64)
        ),
    }
    if args.trace.exists():
        workloads[f"trace ({args.trace.name})"] = trace_requests(args.trace, args.limit)
    capacities = [int(c) for c in args.capacities.split(",")]
    l2 = f"L2 {args.l2_capacity:,} chunks (LRU)" if args.l2_capacity else "L2 unbounded"
    print(f"L1 arc, {l2}; chunks\n")
    print(
        "| workload | L1 | looked up | L2 writes: all | reuse | reuse/all "
        "| L2 hits: all | reuse | reuse/all |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, requests in workloads.items():
        for capacity in capacities:
            w_all, h_all, total = replay(requests, "all", capacity, args.l2_capacity)
            w_reuse, h_reuse, _ = replay(requests, "reuse", capacity, args.l2_capacity)
            print(
                f"| {name} | {capacity:,} | {total:,} | {w_all:,} | {w_reuse:,} "
                f"| {_ratio(w_reuse, w_all)} | {h_all:,} | {h_reuse:,} | {_ratio(h_reuse, h_all)} |"
            )
    counted, committed = cost_per_key()
    print(f"\nadmission cost: {counted:.2f} µs per key counted, {committed:.2f} µs per commit")


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.3f}" if b else "n/a"


if __name__ == "__main__":
    main()
