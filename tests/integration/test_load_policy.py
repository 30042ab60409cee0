"""``load_policy=auto`` in the connector's scheduler side, without vLLM: what it sees when it
judges a hit (the loads in flight per tier, the engine's prefill backlog, the hit's L1 part),
what it hands to the workers (a split loads only the L1 part), how it measures the outcome
afterwards (regret) and how it reports its counters."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from kvtrio.integration._costs import CostModel
from kvtrio.integration._options import ConnectorOptions
from kvtrio.integration._scheduler_side import REPORT_EVERY, SchedulerSide

from .._support.engine_requests import EngineRequest

CHUNK, BLOCK = 64, 16
PROMPT = 5 * CHUNK + 10  # a hit reaches 320 tokens
BLOCKS = list(range(100, 100 + 21))


class Adapter:
    """The scheduler adapter's calls, answering every lookup with ``hits[request]``:
    ``(hit tokens, of them in L1)``."""

    chunk_size = CHUNK

    def __init__(self) -> None:
        self.hits: dict[str, tuple[int, int]] = {}
        self.freed: list[str] = []

    def maybe_submit_lookup_request(self, *args: object, **kwargs: object) -> None:
        pass

    def check_lookup_result(self, request_id: str, wait: float = 0.0) -> int:
        return self.hits.get(request_id, (0, 0))[0]

    def lookup_l1_tokens(self, request_id: str) -> int:
        return self.hits.get(request_id, (0, 0))[1]

    def flush_lookups(self) -> None:
        pass

    def cleanup_lookup_result(self, request_id: str) -> None:
        pass

    def free_lookup_locks(self, request_id: str) -> None:
        self.freed.append(request_id)

    def end_session(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scheduler(model: CostModel) -> tuple[SchedulerSide, Adapter, Clock]:
    adapter, clock = Adapter(), Clock()
    side = SchedulerSide(ConnectorOptions(), BLOCK, adapter, clock=clock)  # type: ignore[arg-type]
    side.policy.model = model
    return side, adapter, clock


def model(per_token: float = 10e-6) -> CostModel:
    """Computing: ``per_token`` s a token; an L1 load ``2 ms + 3 µs × tokens`` (the loads in
    flight included); an L2 load 100 ms for 320 tokens."""
    made = CostModel(min_step_tokens=64, explore_every=1000)
    made.observe_step(1000, per_token * 1000)
    made.observe_load(1000, 0.005, "l1")
    made.observe_load(2000, 0.008, "l1")
    made.observe_load(320, 0.100, "l2")
    return made


def hand_out(
    side: SchedulerSide, request: EngineRequest, scheduled: dict[str, int] | None = None
) -> Any:
    """vLLM's next calls for a request it admitted: allocation, then the step's plan."""
    need, _ = side.matched_tokens(request, 0, preempted=False)
    side.allocated(request, BLOCKS, need or 0)
    return side.build_step(scheduled or {}, (), 0, None)


def test_a_split_loads_only_the_l1_part_and_is_judged_when_it_is_done() -> None:
    # 320 tokens, 128 of them in L1: loading all takes 100 ms (L2), computing all 32 ms,
    # loading the L1 part ~2.4 ms then computing 192 tokens 19.2 ms.
    side, adapter, clock = scheduler(model(per_token=100e-6))
    adapter.hits["r"] = (320, 2 * CHUNK)
    request = EngineRequest("r", PROMPT)
    assert side.matched_tokens(request, 0, preempted=False) == (2 * CHUNK, True)
    assert side.matched_tokens(request, 0, preempted=False) == (2 * CHUNK, True)  # once
    side.allocated(request, BLOCKS, 2 * CHUNK)
    (load,) = side.build_step({}, (), 0, None).transfers
    assert (load.kind, load.op.start, load.op.end) == ("load", 0, 2 * CHUNK)
    assert side.policy.stats == {"loads": 1, "split": 1, "saved_ms": 10}
    clock.now += 0.003
    side.loads_done(["r", "another"])
    assert side.policy.stats["judged"] == 1
    assert "regret" not in side.policy.stats
    # The load's time teaches the L1 line.
    assert side.costs.load_seconds(2 * CHUNK) != pytest.approx(model().load_seconds(2 * CHUNK))


def test_loads_in_flight_make_a_marginal_hit_compute() -> None:
    # 320 L1 tokens: ~2.96 ms to load alone, ~6.8 ms behind the first's 1,280 in flight;
    # computing them takes 1.76 ms, and as long again of waiting for the other request.
    side, adapter, clock = scheduler(model(per_token=5.5e-6))
    adapter.hits.update(first=(1280, 1280), second=(320, 320), third=(320, 320))
    request = EngineRequest("first", 1280 + 10)
    assert side.matched_tokens(request, 0, preempted=False) == (1280, True)  # 5.8 < 7 ms
    side.allocated(request, list(range(100, 181)), 1280)
    (first,) = side.build_step({}, (), 0, None).transfers  # in flight from now
    assert first.kind == "load"
    second = EngineRequest("second", PROMPT)
    assert side.matched_tokens(second, 0, preempted=False) == (0, False)
    assert side.policy.stats["skipped_contention"] == 1
    side.allocated(second, BLOCKS, 0)
    assert adapter.freed == ["second"]  # its pins go at once
    clock.now += 0.002
    side.loads_done(["first"])  # done: the queue is empty again
    assert side.matched_tokens(EngineRequest("third", PROMPT), 0, preempted=False) == (320, True)


def test_the_backlog_makes_a_load_pay_that_an_idle_engine_would_not() -> None:
    # 320 L1 tokens: ~2.96 ms to load against 1.6 ms to compute on an idle engine.
    side, adapter, _ = scheduler(model(per_token=5e-6))
    adapter.hits.update(idle=(320, 320), busy=(320, 320))
    assert side.matched_tokens(EngineRequest("idle", PROMPT), 0, preempted=False) == (0, False)
    assert side.policy.stats["skipped_idle"] == 1
    # A running request with 900 prompt tokens left after this step: 4.5 ms of prefill ahead.
    running = EngineRequest("running", 1000)
    side.new_request(running)
    side.build_step({"running": 100}, (), 100, None)
    assert side.matched_tokens(EngineRequest("busy", PROMPT), 0, preempted=False) == (320, True)


def test_a_skipped_hit_is_timed_until_its_tokens_are_computed() -> None:
    side, adapter, clock = scheduler(model())  # an L2 hit: 100 ms against 3.2 ms
    adapter.hits.update(quick=(320, 0), slow=(320, 0))
    quick, slow = EngineRequest("quick", PROMPT), EngineRequest("slow", PROMPT)
    assert hand_out(side, quick).transfers == []
    assert hand_out(side, slow).transfers == []
    assert side.policy.stats["skipped"] == 2
    clock.now += 0.004
    quick.num_computed_tokens = 320
    side.build_step({"slow": 160}, (), 160, None)
    assert (side.policy.stats["judged"], side.policy.stats["regret"]) == (1, 0)
    clock.now += 0.2  # 204 ms: slower than the load would have been
    slow.num_computed_tokens = 320
    side.build_step({}, (), 0, None)
    assert side.policy.stats["judged"] == 2
    assert side.policy.stats["regret_skips"] == 1
    assert side.finished("quick") is False


def test_a_finished_request_leaves_no_load_in_flight() -> None:
    side, adapter, clock = scheduler(model())
    adapter.hits["r"] = (320, 320)
    hand_out(side, EngineRequest("r", PROMPT))
    side.finished("r")
    clock.now += 1.0
    side.loads_done(["r"])
    assert "judged" not in side.policy.stats
    adapter.hits["s"] = (320, 320)
    assert side.matched_tokens(EngineRequest("s", PROMPT), 0, preempted=False) == (
        320,
        True,
    )  # no queue


def test_the_counters_are_logged_as_json_now_and_then_and_at_shutdown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    side, adapter, clock = scheduler(model())
    adapter.hits["r"] = (320, 320)
    with caplog.at_level(logging.INFO, logger="kvtrio.vllm"):
        hand_out(side, EngineRequest("r", PROMPT))
        clock.now += REPORT_EVERY
        side.build_step({}, (), 0, None)
        clock.now += REPORT_EVERY
        side.build_step({}, (), 0, None)  # nothing new: no line
        side.close()
    lines = [r.getMessage() for r in caplog.records if "kvtrio load policy: " in r.getMessage()]
    assert len(lines) == 2
    counters = [json.loads(line.split("kvtrio load policy: ", 1)[1]) for line in lines]
    assert counters[0] == counters[1]
    assert counters[0]["loads"] == 1
    assert set(counters[0]) == {
        "loads", "split", "in_step", "explored", "saved_ms", "skipped", "skipped_slower",
        "skipped_contention", "skipped_idle", "skipped_tokens", "judged", "regret",
        "regret_loads", "regret_skips", "regret_explored", "regret_ms",
    }  # fmt: skip
    assert sum(counters[0].values()) == 1


def test_a_short_l1_load_in_a_busy_engine_is_loaded_inside_the_step_and_judged_there() -> None:
    # Steps of 50 ms; a 320-token L1 load lands ~3 ms later at a step boundary (the line says),
    # but the workers copied 320 tokens in 0.5 ms: inside the request's first step the batch
    # (the request and one other) waits 1 ms, less than the load between steps.
    side, adapter, clock = scheduler(model())
    side.measured([(8, 0.050)] * 3, [(320, 0.0005), (640, 0.001)])
    adapter.hits.update(other=(0, 0), fast=(320, 320), slow=(320, 0))
    side.new_request(EngineRequest("other", PROMPT))
    fast = EngineRequest("fast", PROMPT)
    assert side.matched_tokens(fast, 0, preempted=False) == (320, False)  # not asynchronous
    assert side.policy.stats["in_step"] == 1
    side.allocated(fast, BLOCKS, 320)
    (load,) = side.build_step({"fast": 10}, (), 10, None).transfers
    assert (load.kind, load.sync, load.tier) == ("load", True, "l1")
    # Judged when its tokens are in: 52 ms after the decision, less the step (50 ms) and the
    # rest (10 tokens), plus the other's wait for the copy: ~2 ms against ~3 ms; no regret.
    clock.now += 0.052
    fast.num_computed_tokens = 330
    side.build_step({}, (), 0, None)
    assert (side.policy.stats["judged"], side.policy.stats["regret"]) == (1, 0)
    # An L2 hit never loads inside the step (the server reads its backend first): this one is
    # computed (100 ms to load against ~10 ms for it and the two others).
    assert side.matched_tokens(EngineRequest("slow", PROMPT), 0, preempted=False) == (0, False)
    assert not side.costs.decide(320, 0, others=2).in_step
    assert side.costs.decide(320, 0, others=2, backlog=100_000).tokens == 320  # between steps


@pytest.mark.parametrize("policy", ["always", "auto"])
def test_a_load_that_failed_from_its_first_block_is_not_offered_again(policy: str) -> None:
    """vLLM asks again after a load only when it failed from its first block (the request is
    back to 0 computed tokens): the request then computes its prompt. Was: the same load was
    offered at every ask, and while the failure lasted (a retrieve refused for a quota, say)
    the request never computed."""
    adapter = Adapter()
    side = SchedulerSide(ConnectorOptions(load_policy=policy), BLOCK, adapter)  # type: ignore[arg-type]
    request = EngineRequest("r", PROMPT)
    adapter.hits["r"] = (5 * CHUNK, 5 * CHUNK)
    need, _ = side.matched_tokens(request, 0, preempted=False)
    assert need == 5 * CHUNK
    side.allocated(request, BLOCKS, need)
    loads = [t for t in side.build_step({}, (), 0, None).transfers if t.kind == "load"]
    assert [(t.op.start, t.op.end) for t in loads] == [(0, 5 * CHUNK)]
    side.loads_done({"r"})  # (its blocks reported failed: vLLM is back to 0 and asks again)
    assert side.matched_tokens(request, 0, preempted=False) == (0, False)
    side.allocated(request, BLOCKS, 0)
    assert not [t for t in side.build_step({}, (), 0, None).transfers if t.kind == "load"]
