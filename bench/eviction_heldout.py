"""Eviction on held-out data: every policy next to LRU, LFU and Belady's optimum, per trace.

    python bench/eviction_heldout.py [--traces mooncake,chat,agent] [--fractions .1,.2,.4,.8]
        [--half tune|test] [--plot docs/eviction.png]

Each trace is cut in two halves by request. ``--half test`` (the default, what the docs
report) replays the whole trace and counts hits over the second half only (the first half
warms the cache); ``--half tune`` does the same inside the first half (its first quarter warms,
its second is measured), the only data the policies' constants were chosen on. Capacities are
fractions of the working set (distinct full chunks) of the half measured. Requests are replayed
as the server stores them (``order="server"``); the optimum is Belady's over the whole stream.
Traces: the Mooncake trace (``/work/shared/traces``) and the two generated ones of
``kvtrio.benchmark._traces`` (multi-turn chat, agent-like).
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvtrio.benchmark._simulate import Row, SimRequest, evaluate, format_table, trace_requests
from kvtrio.benchmark._traces import agent_requests, multi_turn_requests
from kvtrio.storage import EVICTION_POLICIES

TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")


def load(name: str) -> list[SimRequest]:
    if name == "mooncake":
        return trace_requests(TRACE)
    if name == "chat":
        return multi_turn_requests()
    if name == "agent":
        return agent_requests()
    raise SystemExit(f"unknown trace {name!r}")


def measured(requests: Sequence[SimRequest], half: str) -> tuple[list[SimRequest], int]:
    """The requests to replay and the index from which hits count."""
    middle = len(requests) // 2
    if half == "test":
        return list(requests), middle
    return list(requests[:middle]), middle // 2


def doorkeeper_lru(requests: Sequence[SimRequest], capacity: int, start: int) -> float:
    """LRU behind a TinyLFU-style doorkeeper (L1 admission): a chunk is stored only at its
    second sighting within the doorkeeper's window (a set of keys seen once, cleared every
    ``4 × capacity`` sightings); hits counted from request ``start`` on."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    doorkeeper: set[bytes] = set()
    hits = total = 0
    for number, request in enumerate(requests):
        hit = 0
        while hit < request.full and request.keys[hit] in cache:
            hit += 1
        if number >= start:
            hits, total = hits + hit, total + request.full
        for key in reversed(request.keys[: request.full]):
            if key in cache:
                cache.move_to_end(key)
                continue
            if key not in doorkeeper:
                doorkeeper.add(key)
                if len(doorkeeper) > 4 * capacity:
                    doorkeeper.clear()
                continue
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / total if total else 0.0


def plot(results: dict[str, list[Row]], fractions: Sequence[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for axis, (name, rows) in zip(axes[0], results.items(), strict=True):
        for policy in rows[0].ratios:
            style = "--" if policy in ("optimum", "LFU", "lru+doorkeeper") else "-"
            width = 2.5 if policy in ("reuse", "lru", "optimum") else 1.0
            axis.plot(
                [f * 100 for f in fractions],
                [row.ratios[policy] for row in rows],
                style,
                marker="o",
                linewidth=width,
                label=policy,
            )
        axis.set_title(f"{name}: held-out half")
        axis.set_xlabel("L1 capacity, % of the working set")
        axis.set_ylabel("hit ratio (full chunks)")
        axis.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", default="mooncake,chat,agent")
    parser.add_argument("--fractions", default="0.1,0.2,0.4,0.8")
    parser.add_argument("--policies", default=",".join(EVICTION_POLICIES))
    parser.add_argument("--half", choices=("tune", "test"), default="test")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument(
        "--doorkeeper", action="store_true", help="also LRU behind a doorkeeper (L1 admission)"
    )
    args = parser.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
    results = {}
    for name in args.traces.split(","):
        requests, start = measured(load(name), args.half)
        working = len({key for r in requests[start:] for key in r.keys[: r.full]})
        capacities = [max(1, int(f * working)) for f in fractions]
        rows, seconds = evaluate(
            requests, capacities, args.policies.split(","), order="server", start=start
        )
        if args.doorkeeper:
            for row in rows:
                row.ratios["lru+doorkeeper"] = doorkeeper_lru(requests, row.capacity, start)
        results[name] = rows
        print(
            f"\n{name}: {len(requests)} requests, hits counted from request {start} "
            f"({args.half} half), working set {working:,} chunks ({seconds:.0f} s)\n"
        )
        print(format_table(rows))
        for row, fraction in zip(rows, fractions, strict=True):
            lru, best = row.ratios["lru"], row.ratios["optimum"]
            print(
                f"  {fraction:.0%}: lru/optimum {lru / best:.2f}"
                + "".join(
                    f", {p}/lru {row.ratios[p] / lru:.2f}"
                    for p in ("reuse", "arc", "lru+doorkeeper")
                    if p in row.ratios and lru
                )
            )
    if args.plot is not None:
        plot(results, fractions, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
