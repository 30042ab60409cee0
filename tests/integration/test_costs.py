"""``load_policy=auto``: a hit is loaded only when this engine's measurements say loading beats
computing (no engine needed: the measurements are given)."""

from __future__ import annotations

import concurrent.futures
import logging

import pytest

from kvtrio.integration._costs import CostModel, LoadPolicy, Measurements


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
    assert policy.stats == {"skipped": 2, "skipped_tokens": 1024}
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
