"""Offline eviction evaluator: hit ratio by L1 capacity for every policy, LFU and the optimum.

    python bench/eviction.py [--trace FILE] [--capacities 2000,8000,20000,0]
    python bench/eviction.py --chat [--conversations 400 --turns 6 ...] [--capacities ...]

Replays the requests one at a time through the real L1 index and policy classes (no server;
see ``kvtrio.benchmark._simulate`` for the conventions). Capacity counts chunks (0: unbounded).
``--order server`` stores in prompt order with the hits pinned, as the server does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtrio.benchmark._options import BenchOptions
from kvtrio.benchmark._simulate import (
    chat_requests,
    evaluate,
    format_table,
    reuse_distances,
    simulate_hinted_lru,
    trace_requests,
)
from kvtrio.storage import EVICTION_POLICIES

TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--chat", action="store_true", help="the built-in chat workload instead")
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--chunk-size", type=int, default=256, help="chat only")
    parser.add_argument(
        "--interleave", type=int, default=64, help="chat: conversations taking turns at once"
    )
    parser.add_argument("--capacities", default="")
    parser.add_argument("--policies", default=",".join(EVICTION_POLICIES))
    parser.add_argument("--order", choices=("reversed", "server"), default="reversed")
    parser.add_argument("--limit", type=int, default=0, help="trace: first N requests only")
    parser.add_argument(
        "--why",
        action="store_true",
        help="also: reuse distances, and LRU with an oracle hint of which chunks are reused",
    )
    args = parser.parse_args()
    if args.chat:
        options = BenchOptions(
            conversations=args.conversations, system_prompts=args.system_prompts, turns=args.turns
        )
        requests = chat_requests(options, args.chunk_size, args.interleave)
        title = (
            f"chat: {args.conversations} conversations × {args.turns} turns, "
            f"{args.interleave} at a time"
        )
        default_capacities = "200,500,1000,2000,0"
    else:
        requests = trace_requests(args.trace, args.limit)
        title = f"trace: {args.trace.name}"
        default_capacities = "2000,8000,20000,0"
    capacities = [int(c) for c in (args.capacities or default_capacities).split(",")]
    chunks = sum(len(r.keys) for r in requests)
    print(f"{title}: {len(requests)} requests, {chunks:,} chunks, order {args.order}\n")
    rows, seconds = evaluate(requests, capacities, args.policies.split(","), args.order)
    if args.why:
        for row in rows:
            row.ratios["LRU+hint"] = simulate_hinted_lru(requests, row.capacity)
    print(format_table(rows))
    print(f"\n({seconds:.1f} s)")
    if args.why:
        distances = reuse_distances(requests)
        quantiles = ", ".join(
            f"{q:.0%}: {distances[int(q * (len(distances) - 1))]:,}"
            for q in (0.1, 0.25, 0.5, 0.75, 0.9)
        )
        print(f"\nchunks stored between a hit chunk's uses ({len(distances):,} hits): {quantiles}")
        for capacity in capacities:
            if capacity:
                within = sum(d <= capacity for d in distances) / len(distances)
                print(f"  hits within {capacity:,} chunks of their last use: {within:.1%}")


if __name__ == "__main__":
    main()
