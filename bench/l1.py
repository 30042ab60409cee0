"""L1 index cost at 1e3 … 1e6 entries: memory per chunk, lookup, reserve+commit, eviction.

    python bench/l1.py [--sizes 1000,10000,100000,1000000] [--repeats 5]

The arena itself is not touched (the index never reads chunk bytes); each entry gets a 4 KiB
slot so that a million entries fit a 4 GiB address range. Lookups are 64-chunk prefix scans
(a 16k-token prompt at 256 tokens per chunk) of keys that are present. Reported per operation,
median over ``--repeats`` rounds; ``dict`` of the same keys is the baseline for memory and a
plain ``dict`` membership loop for lookups.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import tracemalloc

from kvtrio.storage import L1Cache

SLOT = 4096
PREFIX = 64


def keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def filled(n: int, all_keys: list[bytes]) -> L1Cache:
    l1 = L1Cache(n * SLOT)
    for key in all_keys:
        l1.reserve(key, SLOT)
        l1.commit(key)
    return l1


def memory_per_entry(n: int) -> tuple[float, float]:
    """Bytes per entry of the L1 index, and of a plain dict key → None, same keys."""
    all_keys = keys(n)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    l1 = filled(n, all_keys)
    l1_bytes = tracemalloc.get_traced_memory()[0] - before
    del l1
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    plain = dict.fromkeys(all_keys)
    dict_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del plain
    return l1_bytes / n, dict_bytes / n


def timings(n: int) -> dict[str, float]:
    all_keys = keys(n)
    l1 = filled(n, all_keys)
    prompts = [all_keys[i : i + PREFIX] for i in range(0, min(n, 20_000) - PREFIX, PREFIX)]
    result: dict[str, float] = {}

    t0 = time.perf_counter()
    for prompt in prompts:
        assert l1.prefix(prompt) == len(prompt)
    result["prefix_per_key_ns"] = (time.perf_counter() - t0) / (len(prompts) * PREFIX) * 1e9

    index = dict.fromkeys(all_keys)
    t0 = time.perf_counter()
    for prompt in prompts:
        sum(1 for key in prompt if key in index)
    result["dict_per_key_ns"] = (time.perf_counter() - t0) / (len(prompts) * PREFIX) * 1e9

    # The cache is full: every new chunk evicts the least recently used one.
    fresh = keys(min(n, 20_000))
    t0 = time.perf_counter()
    for key in fresh:
        l1.reserve(key, SLOT)
        l1.commit(key)
    result["store_with_eviction_us"] = (time.perf_counter() - t0) / len(fresh) * 1e6

    t0 = time.perf_counter()
    for key in fresh:
        l1.pin(key)
        l1.unpin(key)
    result["pin_unpin_us"] = (time.perf_counter() - t0) / len(fresh) * 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    print(f"L1 index bench: {PREFIX}-chunk prefix lookups, medians of {args.repeats} rounds\n")
    header = (
        f"{'entries':>10}{'B/entry':>10}{'dict B/entry':>14}{'lookup ns/key':>15}"
        f"{'dict ns/key':>13}{'ratio':>7}{'store+evict µs':>16}{'pin+unpin µs':>14}"
    )
    print(header)
    for n in sizes:
        per_entry, per_dict = memory_per_entry(n)
        rounds = [timings(n) for _ in range(args.repeats)]

        def med(key: str, rounds: list[dict[str, float]] = rounds) -> float:
            return statistics.median(r[key] for r in rounds)

        lookup, baseline = med("prefix_per_key_ns"), med("dict_per_key_ns")
        print(
            f"{n:>10,}{per_entry:>10.0f}{per_dict:>14.0f}{lookup:>15.0f}{baseline:>13.0f}"
            f"{lookup / baseline:>7.1f}{med('store_with_eviction_us'):>16.2f}"
            f"{med('pin_unpin_us'):>14.2f}"
        )


if __name__ == "__main__":
    main()
