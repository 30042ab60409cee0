"""KvtrioConnector inside vLLM's own scheduler and model-runner plumbing, with a real kvtrio server.

No GPU and no model: see :mod:`.harness`. Every step checks, byte for byte, the KV of every token
a request counts as computed, so a load that put wrong bytes anywhere fails the test where it
happens; the kvtrio server's own statistics show what it holds and whether any pin is left.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvtrio.launch import ServerProcess

from ..._support.server_cache import assert_no_pins, cache, wait_chunks
from ..._support.waiting import wait_for
from .harness import Engine, make_config

CHUNK = 64
SERVER_ARGS = ("--chunk-size", str(CHUNK), "--l1-size", "64MiB", "--heartbeat-timeout", "3")
_random = random.Random(5)
PROMPT = [_random.randrange(3, 1000) for _ in range(5 * CHUNK + 10)]  # 5 whole chunks
OTHER = [_random.randrange(3, 1000) for _ in range(3 * CHUNK + 10)]
# Shares 4 chunks and a bit with PROMPT, then differs.
SHARED = [*PROMPT[: 4 * CHUNK + 20], 7, 8, 9]


@pytest.fixture
def kvtrio(server_process: Callable[..., ServerProcess]) -> ServerProcess:
    return server_process(*SERVER_ARGS)


@pytest.fixture
def engines(model_dir: Path, kvtrio: ServerProcess) -> Iterator[Callable[..., Engine]]:
    """``engines(**options)``: a new vLLM scheduler with kvtrio as its connector (the previous
    one is shut down first: vLLM has one worker-side connector per process)."""
    made: list[Engine] = []

    def make(
        *,
        num_blocks: int = 128,
        prefix_caching: bool = False,
        failure_policy: str | None = "recompute",
        **options: Any,
    ) -> Engine:
        for engine in made:
            engine.close()
        engine = Engine(
            make_config(
                model_dir,
                kvtrio.endpoint,
                prefix_caching=prefix_caching,
                failure_policy=failure_policy,
                **options,
            ),
            num_blocks=num_blocks,
        )
        made.append(engine)
        wait_for(lambda: cache(kvtrio).registrations >= 1, what="the worker to register")
        return engine

    yield make
    for engine in made:
        engine.close()


def store_prompt(engine: Engine, server: ServerProcess, prompt: list[int] = PROMPT) -> None:
    engine.add("first", prompt)
    engine.run()
    result = engine.results["first"]
    assert (result.external_cached, len(result.output)) == (0, 4)
    wait_chunks(server, len(prompt) // CHUNK)


# --------------------------------------------------------------------------- loads


def test_sync_load(engines: Callable[..., Engine], kvtrio: ServerProcess) -> None:
    engine = engines(async_load=False)
    store_prompt(engine, kvtrio)
    engine.add("b", SHARED)
    engine.run()
    loads = [s for s in engine.steps if s.has_sync_kv_loads]
    assert len(loads) == 1
    assert loads[0].num_scheduled_tokens["b"] == len(SHARED) - 4 * CHUNK  # the rest, same step
    result = engine.results["b"]
    assert (result.local_cached, result.external_cached) == (0, 4 * CHUNK)
    assert len(result.output) == 4
    stats = cache(kvtrio)
    assert (stats.lookups, stats.lookup_hit_chunks, stats.l1_ready) == (2, 4, 5)
    assert_no_pins(kvtrio)


def test_async_load(engines: Callable[..., Engine], kvtrio: ServerProcess) -> None:
    engine = engines(async_load=True)
    store_prompt(engine, kvtrio)
    engine.add("b", PROMPT)  # the whole prompt: 5 chunks, the engine computes the last 10
    engine.run(until=lambda: engine.status("b") == RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert "b" not in engine.steps[-1].num_scheduled_tokens  # waits while kvtrio loads
    engine.run()
    result = engine.results["b"]
    assert (result.local_cached, result.external_cached) == (0, 5 * CHUNK)
    computed = sum(s.num_scheduled_tokens.get("b", 0) for s in engine.steps)
    assert computed == 10 + 3  # the prompt's last 10 tokens, then 3 decode steps
    assert not any(s.has_sync_kv_loads for s in engine.steps)
    assert_no_pins(kvtrio)


def test_requests_that_arrive_together_are_looked_up_together(
    engines: Callable[..., Engine], kvtrio: ServerProcess
) -> None:
    # Their lookups are queued as they arrive, so the one the scheduling pass waits for takes
    # the others along: all three load in the first step, none waits a step for its lookup.
    # (The one wait may take as long as it needs here: it ends with the reply.)
    engine = engines(async_load=False, lookup_wait=10.0)
    store_prompt(engine, kvtrio)
    for request_id in ("b", "c", "d"):
        engine.add(request_id, SHARED)
    first = engine.step()
    assert set(first.num_scheduled_tokens) == {"b", "c", "d"}
    assert first.has_sync_kv_loads
    engine.run()
    assert [engine.results[r].external_cached for r in "bcd"] == [4 * CHUNK] * 3
    assert cache(kvtrio).lookups == 4
    assert_no_pins(kvtrio)


def test_vllm_prefix_cache_and_kvtrio_together(
    engines: Callable[..., Engine], kvtrio: ServerProcess
) -> None:
    """vLLM's own prefix cache has the first 3 blocks; kvtrio loads the rest of 5 chunks and
    leaves those blocks alone (another request may be reading them)."""
    store_prompt(engines(), kvtrio)
    engine = engines(prefix_caching=True)  # a restarted vLLM: its prefix cache is empty
    engine.add("x", PROMPT[:100])
    engine.run()
    assert engine.results["x"].external_cached == CHUNK  # the one whole chunk
    engine.add("y", PROMPT)
    engine.run()
    result = engine.results["y"]
    assert (result.local_cached, result.external_cached) == (96, 5 * CHUNK - 96)
    assert_no_pins(kvtrio)


# --------------------------------------------------------------------------- stores and frees


def test_blocks_are_held_until_their_stores_are_done(
    engines: Callable[..., Engine], kvtrio: ServerProcess
) -> None:
    engine = engines()
    free = engine.free_blocks()
    engine.add("a", PROMPT, max_tokens=2)
    engine.run(until=lambda: engine.results["a"].finish_reason is not None)
    assert engine.held("a")  # stores were issued: vLLM keeps the blocks for now
    assert engine.free_blocks() < free
    engine.run()  # until the workers report the stores done
    assert engine.free_blocks() == free
    wait_chunks(kvtrio, 5)
    assert_no_pins(kvtrio)


def test_auto_computes_a_hit_that_loading_would_slow_down(
    engines: Callable[..., Engine], kvtrio: ServerProcess
) -> None:
    """Issue 23: ``load_policy=auto`` (the default) reports no hit to vLLM when this engine's
    measurements say loading it takes longer than computing it; the lookup's pins are released,
    the request computes everything and its output is the same."""
    from kvtrio.integration._costs import CostModel

    engine = engines()
    store_prompt(engine, kvtrio)
    engine.add("loaded", PROMPT)
    engine.run()
    assert engine.results["loaded"].external_cached == 5 * CHUNK  # nothing known: loaded
    # Measurements as a tiny model's: a prefill token costs 1 µs, a load of 320 tokens 50 ms.
    measured = CostModel(explore_every=1000)
    measured.observe_step(1000, 0.001)
    measured.observe_load(5 * CHUNK, 0.050)
    engine.connector.scheduler_side.policy.model = measured
    engine.add("computed", PROMPT)
    engine.run()
    result = engine.results["computed"]
    assert result.external_cached == 0
    assert result.output == engine.results["loaded"].output
    assert engine.connector.scheduler_side.policy.stats["skipped"] == 1
    assert_no_pins(kvtrio)


def test_auto_loads_the_l1_part_of_a_hit_and_computes_the_rest(
    engines: Callable[..., Engine], kvtrio: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33: where the server has only the first chunks of a hit in L1 and the rest would
    come slowly from L2, ``auto`` reports only the L1 part to vLLM (fewer external tokens than
    the hit); vLLM loads those, computes the rest, and the output is the same. (The server
    here has no L2: the lookup's tier split is the one input faked.)"""
    from kvtrio.integration._costs import CostModel

    engine = engines()
    store_prompt(engine, kvtrio)
    engine.add("loaded", PROMPT)
    engine.run()
    assert engine.results["loaded"].external_cached == 5 * CHUNK
    side = engine.connector.scheduler_side
    monkeypatch.setattr(side.adapter, "lookup_l1_tokens", lambda request_id: 2 * CHUNK)
    measured = CostModel(explore_every=1000)
    measured.observe_step(1000, 0.100)  # 100 µs a token: 32 ms for the hit
    measured.observe_load(5 * CHUNK, 0.002, "l1")  # L1: fast
    measured.observe_load(5 * CHUNK, 0.500, "l2")  # L2: far slower than computing
    side.policy.model = measured
    engine.add("split", PROMPT)
    engine.run()
    result = engine.results["split"]
    assert result.external_cached == 2 * CHUNK
    assert result.output == engine.results["loaded"].output
    assert (side.policy.stats["split"], side.policy.stats["judged"]) == (1, 1)
    assert_no_pins(kvtrio)
    # The counters reach vLLM's own periodic stats line, summed over its interval.
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    summed = KVConnectorLogging(engine.config.kv_transfer_config)
    for data in engine.connector_stats:
        summed.observe(data)
    lines: list[str] = []
    summed.log(lambda message, *args: lines.append(message % args))
    (line,) = lines
    assert line.startswith("KV Transfer metrics: ")
    assert "loads=2" in line
    assert "split=1" in line
    assert "judged=1" in line
    # and what kvtrio cost the step loop: the scheduler's and the workers' time in its hooks
    spent = dict(re.findall(r"(\w+)=(\d+)", line))
    assert int(spent["requests"]) == len(engine.results)
    assert int(spent["hook_us"]) > 0
    assert int(spent["worker_hook_us"]) > 0


def test_requests_opt_out_with_kv_transfer_params(
    engines: Callable[..., Engine], kvtrio: ServerProcess
) -> None:
    engine = engines()
    store_prompt(engine, kvtrio)
    engine.add("no-save", OTHER, **{"kvtrio.save": False})
    engine.run(until=lambda: engine.results["no-save"].finish_reason is not None)
    assert not engine.held("no-save")  # nothing to wait for
    engine.add("no-load", PROMPT, **{"kvtrio.load": "false"})
    engine.run()
    assert engine.results["no-load"].external_cached == 0
    stats = cache(kvtrio)
    assert (stats.l1_ready, stats.lookups) == (5, 2)  # no store; no lookup for "no-load"
    assert_no_pins(kvtrio)


# --------------------------------------------------------------------------- aborts


def test_aborted_requests_release_every_pin(
    engines: Callable[..., Engine], kvtrio: ServerProcess
) -> None:
    engine = engines()
    free = engine.free_blocks()
    store_prompt(engine, kvtrio)

    # Aborted while kvtrio loads its KV: vLLM frees its blocks once the load has ended.
    engine.add("loading", PROMPT)
    engine.run(until=lambda: engine.status("loading") == RequestStatus.WAITING_FOR_REMOTE_KVS)
    engine.abort("loading")
    engine.run()
    assert_no_pins(kvtrio)

    # Aborted halfway through its prefill, after a load.
    engine.add("computing", [*PROMPT, *OTHER])
    engine.run(until=lambda: "computing" in engine.steps[-1].num_scheduled_tokens)
    assert engine.status("computing") == RequestStatus.RUNNING
    engine.abort("computing")
    engine.run()
    assert engine.results["computing"].output == []
    assert_no_pins(kvtrio)
    assert engine.free_blocks() == free


def test_a_request_aborted_while_waiting_for_blocks_releases_its_lookup_pins(
    engines: Callable[..., Engine], kvtrio: ServerProcess
) -> None:
    store_prompt(engines(), kvtrio)
    engine = engines(num_blocks=20)  # 19 usable blocks of 32 tokens
    engine.add("big", OTHER * 2, max_tokens=40)  # holds 13-14 blocks for a while
    engine.add("waiting", PROMPT)  # needs 11: its lookup pins 5 chunks, then it waits
    engine.run(until=lambda: cache(kvtrio).l1_pins == 5)
    for _ in range(3):
        engine.step()
    assert engine.status("waiting") == RequestStatus.WAITING
    assert cache(kvtrio).l1_pins == 5
    engine.abort("waiting")
    assert_no_pins(kvtrio)
    engine.run()
    assert len(engine.results["big"].output) == 40


# --------------------------------------------------------------------------- kvtrio going away


def test_vllm_keeps_running_while_kvtrio_restarts(
    engines: Callable[..., Engine], kvtrio: ServerProcess
) -> None:
    engine = engines()
    store_prompt(engine, kvtrio)
    kvtrio.kill()
    engine.add("away", PROMPT)  # no hit, no store, no error
    engine.run()
    assert (engine.results["away"].external_cached, len(engine.results["away"].output)) == (0, 4)

    kvtrio.start()  # a new server: nothing cached (no L2 here)
    wait_for(lambda: cache(kvtrio).registrations == 1, what="the worker to register again")
    engine.add("again", PROMPT)
    engine.run()
    assert engine.results["again"].external_cached == 0
    wait_chunks(kvtrio, 5)
    engine.add("hit", SHARED)
    engine.run()
    assert engine.results["hit"].external_cached == 4 * CHUNK
    assert_no_pins(kvtrio)


@pytest.mark.parametrize("policy", ["recompute", None], ids=["recompute", "vllm-default"])
@pytest.mark.parametrize("async_load", [True, False], ids=["async", "sync"])
def test_a_load_that_fails_is_recomputed(
    engines: Callable[..., Engine], kvtrio: ServerProcess, async_load: bool, policy: str | None
) -> None:
    """kvtrio dies between the lookup and the load: the worker reports the blocks failed and
    vLLM recomputes them (the harness checks they were reported before anything reads them).
    Also with vLLM's default ``kv_load_failure_policy`` (``fail``): the connector sets it to
    ``recompute`` (was: the request ended with an error)."""
    engine = engines(async_load=async_load, failure_policy=policy)
    assert engine.scheduler.recompute_kv_load_failures
    store_prompt(engine, kvtrio)
    engine.add("b", PROMPT)
    while True:
        output = engine.schedule()
        metadata = output.kv_connector_metadata
        if any(t.kind == "load" for t in getattr(metadata, "transfers", ())):
            break
        engine.execute(output)
    kvtrio.kill()
    engine.execute(output)
    engine.run()
    assert engine.failed_blocks  # reported, so vLLM recomputed them
    result = engine.results["b"]
    assert len(result.output) == 4
    computed = sum(s.num_scheduled_tokens.get("b", 0) for s in engine.steps)
    assert computed >= len(PROMPT) + 3  # everything was computed after all


def test_load_failure_fail_keeps_vllms_fail_policy(
    engines: Callable[..., Engine], kvtrio: ServerProcess
) -> None:
    """``kvtrio.load_failure=fail``: vLLM fails a request whose load failed."""
    engine = engines(failure_policy=None, load_failure="fail")
    assert not engine.scheduler.recompute_kv_load_failures
    assert engine.config.kv_transfer_config.kv_load_failure_policy == "fail"


def test_cpu_kernels_with_an_unknown_kv_packing_are_refused(
    model_dir: Path, kvtrio: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM picks its CPU attention kernels by instruction set; kvtrio knows how the vec and
    vec16 kernels pack K and V (tests/integration/vllm_cpu/test_layout.py). On a CPU where vLLM
    would use others (AMX here stands in: this machine has none), the worker refuses to start
    rather than share chunks whose bytes mean something else."""
    from vllm.v1.attention.backends import cpu_attn

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *args: "amx")
    with pytest.raises(ValueError, match="'amx' kernels here"):
        Engine(make_config(model_dir, kvtrio.endpoint), num_blocks=8)
