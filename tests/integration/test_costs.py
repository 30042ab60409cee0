"""``load_policy=auto``: a hit is loaded only when this engine's measurements say loading beats
computing (no engine needed: the measurements are given)."""

from __future__ import annotations

import concurrent.futures
import logging

import pytest

from kvtrio.integration._costs import CostModel, LoadPolicy
from kvtrio.integration._measurements import Measurements


def test_unknown_costs_load_and_the_first_measurements_decide() -> None:
    model = CostModel(min_step_tokens=64)
    assert model.worth_loading(512).load  # nothing known: load, and learn from it
    model.observe_step(512, 0.512)  # 1 ms per token of prefill
    assert model.worth_loading(512).load  # still no load measured
    model.observe_load(512, 0.050)
    decision = model.worth_loading(512)
    assert decision.load
    assert decision.load_seconds == pytest.approx(0.050)
    assert decision.compute_seconds == pytest.approx(0.512)


def test_decode_steps_do_not_teach_the_compute_cost() -> None:
    model = CostModel(min_step_tokens=64)
    model.observe_step(1, 0.5)  # a decode step: slow per token, not a prefill rate
    assert model.compute_seconds(100) is None
    model.observe_step(100, 0.01)
    assert model.compute_seconds(100) == pytest.approx(0.01)


def test_loads_fit_a_fixed_and_a_per_token_cost() -> None:
    model = CostModel()
    for tokens in (256, 512, 1024, 2048):
        model.observe_load(tokens, 0.020 + tokens * 1e-5)
    assert model.load_seconds(0) == pytest.approx(0.020)
    assert model.load_seconds(4096) == pytest.approx(0.020 + 4096e-5)


def test_a_hit_that_is_cheaper_to_compute_is_not_loaded_but_explored_now_and_then() -> None:
    model = CostModel(min_step_tokens=64, explore_every=4)
    model.observe_step(600, 0.006)  # a tiny model: 10 µs per token
    model.observe_load(512, 0.030)  # a load: 30 ms (round trips, a step of waiting)
    decisions = [model.worth_loading(512) for _ in range(8)]
    assert [d.load for d in decisions] == [False, False, False, True] * 2
    assert [d.explored for d in decisions] == [False, False, False, True] * 2
    # Long hits pay where short ones do not: the fixed cost is shared by more tokens.
    model.observe_load(4096, 0.034)
    assert model.worth_loading(8192).load


def test_the_policy_counts_what_it_skipped_and_says_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = CostModel(min_step_tokens=64, explore_every=100)
    model.observe_step(600, 0.006)
    model.observe_load(512, 0.030)
    policy = LoadPolicy("auto", model)
    with caplog.at_level(logging.INFO, logger="kvtrio.vllm"):
        assert not policy.load("r1", 512)
        assert not policy.load("r2", 512)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1
    assert "computed, not loaded" in infos[0].getMessage()
    # (An idle engine computes the hit at once: nothing queued hides the load.)
    assert policy.stats == {"skipped": 2, "skipped_idle": 2, "skipped_tokens": 1024}
    always = LoadPolicy("always", model)
    assert always.load("r3", 512)
    assert always.stats == {"loads": 1}
    # A hit that pays: loaded, and the time it saves is estimated.
    model.observe_step(600, 0.6)  # the median of 0.01 and 1 ms per token
    assert policy.load("r4", 512)
    assert policy.stats["saved_ms"] > 0


def test_a_worker_measures_its_forward_steps_and_its_loads() -> None:
    measured = Measurements()
    assert measured.report() is None
    measured.step_started(256)
    measured.step_done()
    measured.step_done()  # no step running: nothing
    measured.step_started(0)  # an empty step: not timed
    measured.step_done()
    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    measured.time_load(512, future)
    report = measured.report()
    assert report is not None
    assert [t for t, _ in report[0]] == [256]
    assert report[1] == []
    future.set_result(None)
    report = measured.report()
    assert report is not None
    assert [t for t, _ in report[1]] == [512]
    assert measured.report() is None


# --------------------------------------------------------------------------- under contention


def contended_model(per_token: float = 10e-6, **kwargs: int) -> CostModel:
    """Computing costs ``per_token`` s a token; an L1 load ``2 ms + 3 µs × tokens`` (tokens of
    the loads in flight included); an L2 load 50 ms for 1,000 tokens."""
    model = CostModel(min_step_tokens=64, **kwargs)
    model.observe_step(1000, per_token * 1000)
    model.observe_load(1000, 0.005, "l1")
    model.observe_load(500, 0.008, "l1", queued=1500)  # (2,000 with those in flight: 8 ms)
    model.observe_load(1000, 0.050, "l2")
    return model


def test_loads_in_flight_make_a_marginal_load_skip() -> None:
    model = contended_model()
    alone = model.decide(1000, 1000)
    assert alone.tokens == 1000  # 5 ms against 10 ms of computing
    assert alone.load_seconds == pytest.approx(0.005)
    crowded = model.decide(1000, 1000, queued_l1=3000)  # 2 + 3 × 4,000 µs = 14 ms
    assert crowded.tokens == 0
    assert crowded.reason == "contention"
    assert crowded.load_seconds == pytest.approx(0.014)
    # Loads in flight on another tier do not share this one's queue.
    assert model.decide(1000, 1000, queued_l2=3000).tokens == 1000


def test_an_idle_engine_computes_what_a_backlog_would_hide() -> None:
    model = contended_model(per_token=4e-6)  # 4 ms to compute 1,000 tokens, 5 ms to load them
    idle = model.decide(1000, 1000)
    assert (idle.tokens, idle.reason) == (0, "idle")
    # 500 tokens queued ahead (2 ms): the engine computes the hit at 6 ms, the load is there
    # at 5 ms, while the request would still be waiting.
    busy = model.decide(1000, 1000, backlog=500)
    assert busy.tokens == 1000
    assert busy.compute_seconds == pytest.approx(0.006)
    assert busy.wait_seconds == pytest.approx(0.002)
    # Behind a backlog, a load much slower than the prefill still does not pay.
    slow = model.decide(1000, 0, backlog=500)  # from L2: 50 ms
    assert (slow.tokens, slow.reason) == (0, "slower")


def test_an_l2_hit_on_a_slow_tier_is_computed_where_an_l1_hit_loads() -> None:
    model = contended_model()
    assert model.decide(1000, 1000).tokens == 1000  # L1: 5 ms against 10 ms
    from_l2 = model.decide(1000, 0)  # L2: 50 ms against 10 ms
    assert (from_l2.tokens, from_l2.reason) == (0, "idle")
    assert from_l2.load_seconds == pytest.approx(0.050)
    # An unknown tier is loaded, to learn it.
    fresh = CostModel(min_step_tokens=64)
    fresh.observe_step(1000, 0.010)
    fresh.observe_load(1000, 0.005, "l1")
    assert fresh.decide(1000, 0).tokens == 1000


def test_a_split_loads_the_l1_part_and_computes_the_rest() -> None:
    model = contended_model()
    # 2,000 tokens, the first 1,000 in L1: loading all takes ~100 ms (L2), computing all
    # 20 ms, loading the L1 part 5 ms then computing the rest 10 ms: 15 ms.
    decision = model.decide(2000, 1000)
    assert decision.split
    assert decision.tokens == 1000
    assert decision.chosen_seconds == pytest.approx(0.015)
    assert decision.alternative_seconds == pytest.approx(0.020)
    # With a fast L2 the whole hit loads.
    for _ in range(32):
        model.observe_load(2000, 0.008, "l2")
    whole = model.decide(2000, 1000)
    assert (whole.tokens, whole.split) == (2000, False)


def test_a_split_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    policy = LoadPolicy("auto", contended_model())
    decision = policy.decide("r", 2000, 1000)
    assert decision.split
    assert policy.stats == {"loads": 1, "split": 1, "saved_ms": 5}


def test_regret_is_counted_both_ways() -> None:
    policy = LoadPolicy("auto", contended_model())
    # A load chosen at 5 ms against 10 ms of computing: it took 4 ms (no regret), then one
    # took 30 ms (regret: 20 ms slower than computing would have been).
    assert policy.decide("fast", 1000, 1000).load
    assert policy.decide("slow", 1000, 1000).load
    policy.load_measured("fast", 0.004)
    policy.load_measured("slow", 0.030)
    assert (policy.stats["judged"], policy.stats["regret"]) == (2, 1)
    assert policy.stats["regret_loads"] == 1
    assert policy.stats["regret_ms"] == 20
    # A skipped hit (L2: 50 ms to load against 10 ms to compute) computed in 12 ms: no regret;
    # one computed in 80 ms (the engine was slower than measured): regret.
    assert not policy.decide("computed", 1000, 0).load
    assert not policy.decide("late", 1000, 0).load
    policy.compute_measured("computed", 0.012)
    policy.compute_measured("late", 0.080)
    assert (policy.stats["judged"], policy.stats["regret"]) == (4, 2)
    assert policy.stats["regret_skips"] == 1
    # Each decision is judged once; an ended request's is forgotten.
    policy.compute_measured("late", 0.080)
    assert not policy.decide("gone", 1000, 0).load
    policy.forget("gone")
    policy.compute_measured("gone", 1.0)
    assert policy.stats["judged"] == 4
    # While the costs are unknown nothing is judged (no estimate of the alternative).
    learning = LoadPolicy("auto", CostModel())
    assert learning.decide("first", 1000, 1000).load
    learning.load_measured("first", 1.0)
    assert "judged" not in learning.stats


def test_exploring_still_happens_and_backs_off_while_it_does_not_pay() -> None:
    policy = LoadPolicy("auto", contended_model(explore_every=4, max_explore_every=16))

    def explored_after() -> int:
        """Skipped L2 hits until one is loaded to explore (its load then measured slow)."""
        for count in range(1, 100):
            decision = policy.decide(f"r{count}", 1000, 0)
            if decision.load:
                assert decision.explored
                policy.load_measured(f"r{count}", 0.050)  # slower than computing: regret
                return count
            policy.forget(f"r{count}")
        raise AssertionError("never explored")

    assert [explored_after() for _ in range(4)] == [4, 8, 16, 16]
    assert policy.stats["explored"] == 4
    assert policy.stats["regret_explored"] == 4
    # An exploration that pays resets the gap.
    for count in range(1, 100):
        if policy.decide(f"p{count}", 1000, 0).load:
            policy.load_measured(f"p{count}", 0.001)
            break
        policy.forget(f"p{count}")
    assert explored_after() == 4


def test_a_decision_takes_microseconds() -> None:
    """Not a timing assertion: the decision refits nothing (the lines are fitted once per new
    sample), which a count of the fits shows."""
    model = contended_model()
    model.decide(2000, 1000, queued_l1=10, backlog=10)
    fitted = dict(model._lines)
    fits = [line._fit for line in fitted.values()]
    for _ in range(100):
        model.decide(2000, 1000, queued_l1=10, backlog=10)
    assert [line._fit for line in fitted.values()] == fits
    assert all(fit is not None for fit in fits)


def test_the_counters_gained_since_the_last_look_for_vllms_stats() -> None:
    policy = LoadPolicy("auto", contended_model())
    assert policy.since_last() == {}
    policy.decide("a", 1000, 1000)
    policy.decide("b", 1000, 0)
    assert policy.since_last() == {
        "loads": 1, "saved_ms": 5, "skipped": 1, "skipped_idle": 1, "skipped_tokens": 1000,
    }  # fmt: skip
    assert policy.since_last() == {}
    policy.load_measured("a", 0.001)
    assert policy.since_last() == {"judged": 1}


def test_contention_is_named_where_only_the_split_would_have_paid() -> None:
    model = contended_model()
    # 2,000 tokens, 1,000 in L1: the split pays alone (15 ms against 20 ms), not behind
    # 5,000 L1 tokens in flight (2 + 18 + 10 = 30 ms); loading all from L2 never does.
    assert model.decide(2000, 1000).split
    crowded = model.decide(2000, 1000, queued_l1=5000)
    assert (crowded.tokens, crowded.reason) == (0, "contention")


# ------------------------------------------------------------------- under a served load


def test_other_requests_make_a_load_pay_that_an_idle_engine_would_compute() -> None:
    model = contended_model(per_token=4e-6)  # 4 ms to compute 1,000 tokens, 5 ms to load them
    assert model.decide(1000, 1000).reason == "idle"
    # Three other requests in the engine: each waits 4 ms more for its next step while the
    # hit is computed, so computing costs 16 ms in all against the load's 5 ms.
    served = model.decide(1000, 1000, others=3)
    assert served.tokens == 1000
    assert served.compute_seconds == pytest.approx(0.016)
    # A load slower than all of that is still computed, and the reason is no longer "idle".
    slow = model.decide(1000, 0, others=3)  # from L2: 50 ms
    assert (slow.tokens, slow.reason) == (0, "slower")
    assert slow.others_seconds == pytest.approx(0.012)
    # A split's computed L2 part makes the others wait as well.
    split = model.decide(2000, 1000, others=1)  # 5 ms + 1,000 × 4 µs × 2 = 13 ms
    assert split.split
    assert split.chosen_seconds == pytest.approx(0.013)


def test_a_computed_hit_is_judged_without_its_own_step_and_with_the_others_wait() -> None:
    # Steps of 30 ms: a computed hit's measured time includes the step that computed it, which
    # a load would have needed after landing too; the request's rest (100 tokens) likewise.
    model = contended_model(per_token=10e-6)
    for _ in range(3):
        model.observe_step(8, 0.030)  # decode steps: they teach the step, not the per-token cost
    assert model.step_seconds() == pytest.approx(0.030)
    policy = LoadPolicy("auto", model)
    decision = policy.decide("r", 1000, 0, rest=100)  # L2: 50 ms against 10 ms
    assert not decision.load
    assert decision.tail_seconds == pytest.approx(0.031)
    policy.compute_measured("r", 0.045)  # 45 - 31 = 14 ms of computing the hit: < 50 ms
    assert (policy.stats["judged"], policy.stats["regret"]) == (1, 0)
    # With two others in the engine the same measurement is judged with their wait: 14 + 20 ms
    # against the load's 50 ms, still no regret; a hit that took 80 ms more is one.
    assert not policy.decide("s", 1000, 0, rest=100, others=2).load
    policy.compute_measured("s", 0.125)  # 94 + 20 = 114 ms > 50 ms
    assert policy.stats["regret_skips"] == 1


def test_a_short_copy_loads_inside_the_step_where_the_batch_waits_less_than_a_step() -> None:
    model = contended_model(per_token=10e-6)  # the load line: 5 ms for 1,000 L1 tokens
    assert not model.decide(1000, 1000).in_step  # no copy timed yet: between steps
    model.observe_copy(1000, 0.001)
    model.observe_copy(2000, 0.002)  # the workers copy 1,000 tokens in 1 ms
    alone = model.decide(1000, 1000)
    assert (alone.tokens, alone.in_step) == (1000, True)
    assert alone.chosen_seconds == pytest.approx(0.001)
    # Ten requests share the step: they would all wait 1 ms, 11 ms in all, more than the
    # load between steps (5 ms) costs its own request.
    crowded = model.decide(1000, 1000, others=10)
    assert (crowded.tokens, crowded.in_step) == (1000, False)
    # An L2 part is never copied inside the step.
    assert not model.decide(1000, 0).in_step


def test_only_whole_steps_of_backlog_hide_a_load_between_steps() -> None:
    """vLLM schedules a step's token budget (``max_num_batched_tokens``): a backlog smaller
    than it delays the request by nothing, so a load between steps, which lands a step later,
    is not hidden behind it; whole steps of backlog still are."""
    model = contended_model(per_token=10e-6, step_budget=2048)
    model.observe_copy(1000, 0.001)
    model.observe_copy(2000, 0.002)  # the workers copy 1,000 tokens in 1 ms
    # 1,500 tokens queued: counted token by token (no budget) they would be 15 ms of waiting,
    # hiding the 5 ms load; within one step they hide nothing, and three others waiting 1 ms
    # for a copy inside the step (4 ms with the request's own) cost less than the request's
    # 5 ms between steps.
    assert model.waited(1500) == 0
    within = model.decide(1000, 1000, backlog=1500, others=3)
    assert (within.tokens, within.in_step, within.wait_seconds) == (1000, True, 0.0)
    unbudgeted = contended_model(per_token=10e-6)
    unbudgeted.observe_copy(1000, 0.001)
    unbudgeted.observe_copy(2000, 0.002)
    assert not unbudgeted.decide(1000, 1000, backlog=1500, others=3).in_step
    # Two whole steps ahead (4,096 of 5,000 tokens: 41 ms): the load is hidden behind them.
    assert model.waited(5000) == 4096
    behind = model.decide(1000, 1000, backlog=5000, others=3)
    assert (behind.tokens, behind.in_step) == (1000, False)
    assert behind.wait_seconds == pytest.approx(0.04096)
