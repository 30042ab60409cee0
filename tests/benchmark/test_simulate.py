"""The offline eviction evaluator: its conventions checked against independent computations,
the optimum bounds every policy, ``kvtrio bench --simulate`` prints the table. The full-trace
figures of issue 16 are checked when ``KVTRIO_EVICTION_FIGURES=1`` (about a minute)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtrio.benchmark import BenchOptions
from kvtrio.benchmark._simulate import (
    SimRequest,
    chat_requests,
    evaluate,
    simulate_lfu,
    simulate_optimum,
    simulate_policy,
    trace_requests,
)
from kvtrio.benchmark._traces import agent_requests, multi_turn_requests
from kvtrio.storage import EVICTION_POLICIES, LRU

TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
KVTRIO = str(Path(sys.executable).with_name("kvtrio"))


def chat(conversations: int = 40) -> list[SimRequest]:
    options = BenchOptions(conversations=conversations, system_prompts=3, turns=4)
    return chat_requests(options, 256, interleave=8)


def unbounded_ratio(requests: list[SimRequest]) -> float:
    seen: set[bytes] = set()
    hits = total = 0
    for request in requests:
        hit = 0
        while hit < request.full and request.keys[hit] in seen:
            hit += 1
        hits, total = hits + hit, total + request.full
        seen.update(request.keys)
    return hits / total


def lru_ratio(requests: list[SimRequest], capacity: int) -> float:
    """Plain LRU with the evaluator's conventions, written independently."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = total = 0
    for request in requests:
        hit = 0
        while hit < request.full and request.keys[hit] in cache:
            hit += 1
        for key in reversed(request.keys[:hit]):
            cache.move_to_end(key)
        hits, total = hits + hit, total + request.full
        for key in reversed(request.keys):
            cache[key] = None
            cache.move_to_end(key)
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / total


@pytest.mark.parametrize("order", ["reversed", "server"])
def test_an_unbounded_cache_hits_every_repeated_prefix_under_every_policy(order: str) -> None:
    requests = chat()
    expected = unbounded_ratio(requests)
    for name, factory in EVICTION_POLICIES.items():
        assert simulate_policy(requests, 0, factory, order) == pytest.approx(expected), name
    assert simulate_lfu(requests, 0) == pytest.approx(expected)
    assert simulate_optimum(requests, 0) == pytest.approx(expected)


def test_lru_through_the_real_l1_matches_an_independent_lru() -> None:
    requests = chat()
    for capacity in (20, 60, 150):
        assert simulate_policy(requests, capacity, LRU) == pytest.approx(
            lru_ratio(requests, capacity)
        )


@pytest.mark.skipif(not TRACE.is_file(), reason="the shared trace is not here")
def test_the_optimum_bounds_every_policy_and_lfu() -> None:
    requests = trace_requests(TRACE, limit=300)
    rows, _ = evaluate(requests, [300, 1500])
    for row in rows:
        best = row.ratios["optimum"]
        assert all(value <= best + 1e-9 for value in row.ratios.values()), row


@pytest.mark.skipif(
    os.environ.get("KVTRIO_EVICTION_FIGURES") != "1" or not TRACE.is_file(),
    reason="opt-in: KVTRIO_EVICTION_FIGURES=1 (needs the shared trace, about a minute)",
)
def test_issue_16_figures_are_reproduced() -> None:
    requests = trace_requests(TRACE)
    expected = {  # capacity: (LRU, LFU, optimum), from issue 16
        2000: (0.151, 0.137, 0.378),
        8000: (0.385, 0.377, 0.611),
        20000: (0.590, 0.612, 0.659),
        0: (0.659, 0.659, 0.659),
    }
    rows, _ = evaluate(requests, list(expected), policies=["lru"])
    for row in rows:
        got = (row.ratios["lru"], row.ratios["LFU"], row.ratios["optimum"])
        assert got == pytest.approx(expected[row.capacity], abs=0.002), row.capacity


def test_kvtrio_bench_simulate_prints_the_table() -> None:
    run = subprocess.run(
        [KVTRIO, "bench", "--simulate", "--conversations", "20", "--capacities", "30,0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "| capacity (chunks) | lru | arc |" in run.stdout
    assert "| unbounded |" in run.stdout
    bad = subprocess.run(
        [KVTRIO, "bench", "--simulate", "--capacities", "x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2
    assert "--capacities" in bad.stderr


def test_a_held_out_half_counts_only_its_own_requests() -> None:
    """``start``: the requests before it warm the cache and count nothing."""
    a = SimRequest((b"a1", b"a2"), 2)
    b = SimRequest((b"b1",), 1)
    requests = [a, b, a, a]
    for name in ("lru", "reuse"):
        assert simulate_policy(requests, 0, EVICTION_POLICIES[name], "server", start=2) == 1.0
        assert simulate_policy(requests, 0, EVICTION_POLICIES[name], "server") == 4 / 7
    assert simulate_optimum(requests, 0, start=2) == 1.0
    assert simulate_lfu(requests, 0, start=2) == 1.0


@pytest.mark.parametrize("generate", [multi_turn_requests, agent_requests])
def test_generated_traces_are_deterministic_and_prefix_chained(
    generate: Callable[..., list[SimRequest]],
) -> None:
    requests = generate(300)
    assert requests == generate(300)
    assert len(requests) == 300
    parents: dict[bytes, bytes | None] = {}
    for request in requests:
        assert 0 < request.full <= len(request.keys) <= request.full + 1
        for index, key in enumerate(request.keys):
            parent = request.keys[index - 1] if index else None
            assert parents.setdefault(key, parent) == parent  # a key names its whole prefix
    assert simulate_optimum(requests, 0) > 0.3  # (they reuse)


def test_kvtrio_bench_simulate_held_out_counts_the_second_half() -> None:
    run = subprocess.run(
        [
            *(KVTRIO, "bench", "--simulate", "--held-out", "--conversations", "20"),
            *("--capacities", "30", "--sim-order", "server"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "(held-out half)" in run.stdout
    assert " reuse " in run.stdout
