"""L1 index cost at 1e3 … 1e6 entries: memory per chunk, lookup, reserve+commit, eviction.

    python bench/l1.py [--sizes 1000,10000,100000,1000000] [--repeats 5] [--policies arc,lru]

The arena itself is not touched (the index never reads chunk bytes); each entry gets a 4 KiB
slot so that a million entries fit a 4 GiB address range. Lookups are 64-chunk prefix scans
(a 16k-token prompt at 256 tokens per chunk) of keys that are present. Reported per operation,
median over ``--repeats`` rounds; ``dict`` of the same keys is the baseline for memory and a
plain ``dict`` membership loop for lookups. Each eviction policy is measured in the same run;
``vs lru`` is its lookup and store+evict cost over plain LRU's. Chunks are stored with their
parent (64-chunk prompts, head first), as the server does.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import tracemalloc

from kvtrio.storage import DEFAULT_EVICTION, EVICTION_POLICIES, L1Cache, make_policy

SLOT = 4096
PREFIX = 64


def keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def filled(n: int, all_keys: list[bytes], policy: str = DEFAULT_EVICTION) -> L1Cache:
    l1 = L1Cache(n * SLOT, policy=make_policy(policy))
    store(l1, all_keys)
    return l1


def store(l1: L1Cache, all_keys: list[bytes]) -> None:
    """Store ``all_keys`` as 64-chunk prompts, head first, each chunk with its parent."""
    for index, key in enumerate(all_keys):
        l1.reserve(key, SLOT, parent=all_keys[index - 1] if index % PREFIX else None)
        l1.commit(key)


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


def timings(n: int, policy: str) -> dict[str, float]:
    all_keys = keys(n)
    l1 = filled(n, all_keys, policy)
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

    # The cache is full: every new chunk evicts one.
    fresh = keys(min(n, 20_000))
    t0 = time.perf_counter()
    store(l1, fresh)
    result["store_with_eviction_us"] = (time.perf_counter() - t0) / len(fresh) * 1e6

    present = [key for key in fresh if l1.get(key) is not None]  # (not all policies keep all)
    t0 = time.perf_counter()
    for key in present:
        l1.pin(key)
        l1.unpin(key)
    result["pin_unpin_us"] = (time.perf_counter() - t0) / len(present) * 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policies", default=",".join(EVICTION_POLICIES))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    policies = args.policies.split(",")
    if "lru" not in policies:
        policies.insert(0, "lru")

    print(f"L1 index bench: {PREFIX}-chunk prefix lookups, medians of {args.repeats} rounds")
    print(f"B/entry: the default policy ({DEFAULT_EVICTION}); vs lru: lookup, store+evict\n")
    header = (
        f"{'entries':>10}{'policy':>8}{'B/entry':>9}{'dict B/entry':>14}{'lookup ns/key':>15}"
        f"{'dict ns/key':>13}{'ratio':>7}{'store+evict µs':>16}{'pin+unpin µs':>14}"
        f"{'vs lru':>13}"
    )
    print(header)
    for n in sizes:
        per_entry, per_dict = memory_per_entry(n)
        base: dict[str, float] = {}
        for policy in policies:
            rounds = [timings(n, policy) for _ in range(args.repeats)]

            def med(key: str, rounds: list[dict[str, float]] = rounds) -> float:
                return statistics.median(r[key] for r in rounds)

            lookup, baseline = med("prefix_per_key_ns"), med("dict_per_key_ns")
            evict = med("store_with_eviction_us")
            if policy == "lru":
                base = {"lookup": lookup, "evict": evict}
            print(
                f"{n:>10,}{policy:>8}{per_entry:>9.0f}{per_dict:>14.0f}{lookup:>15.0f}"
                f"{baseline:>13.0f}{lookup / baseline:>7.1f}{evict:>16.2f}"
                f"{med('pin_unpin_us'):>14.2f}"
                f"{lookup / base['lookup']:>6.2f}/{evict / base['evict']:>5.2f}×"
            )


if __name__ == "__main__":
    main()
