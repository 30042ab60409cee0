"""How long the connector's scheduler side waits for a lookup's answer (``kvtrio.lookup_wait``):
the rule alone, and what the scheduler side asks of the adapter with it, without vLLM."""

from __future__ import annotations

import pytest

from kvtrio.integration._costs import CostModel
from kvtrio.integration._lookup_wait import LookupWait
from kvtrio.integration._options import ConnectorOptions, parse_options
from kvtrio.integration._scheduler_side import SchedulerSide

from .._support.engine_requests import EngineRequest

BLOCK = 16


def test_a_wait_is_a_step_shared_by_the_requests_it_holds_up() -> None:
    wait = LookupWait()
    assert wait.seconds(0.0, others=3) == 0.02  # no step measured yet
    assert wait.seconds(0.150, others=0) == pytest.approx(0.150)  # idle: up to a step
    assert wait.seconds(0.150, others=4) == pytest.approx(0.030)
    assert wait.seconds(0.010, others=100) == 0.001  # the floor
    assert wait.seconds(3.0, others=0) == 0.5  # the cap


def test_a_fixed_wait_overrides_the_rule() -> None:
    assert LookupWait(0.2).seconds(0.010, others=50) == 0.2
    assert LookupWait(0.0).seconds(1.0, others=0) == 0.0


def test_the_option_reads_auto_or_seconds() -> None:
    assert ConnectorOptions().lookup_wait is None
    assert parse_options({"kvtrio.lookup_wait": "auto"}).lookup_wait is None
    assert parse_options({"kvtrio.lookup_wait": "0.2"}).lookup_wait == 0.2
    with pytest.raises(ValueError, match=r"kvtrio\.lookup_wait: expected 0 ≤ seconds"):
        parse_options({"kvtrio.lookup_wait": -1})
    with pytest.raises(ValueError, match=r"kvtrio\.lookup_wait: expected a number"):
        parse_options({"kvtrio.lookup_wait": "soon"})


def test_late_answers_are_counted_once() -> None:
    wait = LookupWait()
    wait.waited(0.001, answered=True)
    wait.waited(0.005, answered=False)
    assert wait.since_last() == {"lookups_waited": 2, "lookups_late": 1}
    assert wait.since_last() == {}


def test_the_wait_covers_the_usual_answer_up_to_a_step() -> None:
    wait = LookupWait()
    for _ in range(20):
        wait.waited(0.008, answered=True)  # answers take 8 ms on this machine
    assert wait.seconds(0.020, others=3) == pytest.approx(0.012)  # 1.5 × 8 ms, not 20 / 4
    assert wait.seconds(0.400, others=3) == pytest.approx(0.100)  # the shared step is longer
    for _ in range(3):
        wait.waited(0.012, answered=False)  # > 10 % late: the usual answer is "endless"
    assert wait.seconds(0.020, others=3) == pytest.approx(0.020)  # a step at most


class Adapter:
    """Records the waits it is asked for; answers a lookup waited for with ``answer``."""

    chunk_size = 64

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.answer: int | None = None

    def maybe_submit_lookup_request(self, *args: object, **kwargs: object) -> None:
        pass

    def check_lookup_result(self, request_id: str, wait: float = 0.0) -> int | None:
        if wait <= 0:
            return None
        self.waits.append(wait)
        return self.answer

    def flush_lookups(self) -> None:
        pass


def test_the_scheduler_waits_once_a_pass_as_long_as_the_engine_can_afford() -> None:
    adapter = Adapter()
    side = SchedulerSide(ConnectorOptions(), BLOCK, adapter)  # type: ignore[arg-type]
    side.policy.model = CostModel()
    side.policy.model.observe_step(4, 0.120)  # the engine's steps take 120 ms
    for name in ("a", "b", "c"):
        side.new_request(EngineRequest(name))
    # Three requests in the engine: the first unanswered one waits 120 / 3 ms, the others
    # of the pass not at all.
    assert side.matched_tokens(EngineRequest("a"), 0, preempted=False) == (None, False)
    assert side.matched_tokens(EngineRequest("b"), 0, preempted=False) == (None, False)
    assert adapter.waits == [pytest.approx(0.040)]
    side.build_step({}, (), 0, None)  # the next pass may wait again: as the answer came
    adapter.answer = 0  # late, the usual answer is "endless", and it waits up to a step
    assert side.matched_tokens(EngineRequest("a"), 0, preempted=False) == (0, False)
    assert adapter.waits == [pytest.approx(0.040), pytest.approx(0.120)]
    assert side.lookup_wait.since_last() == {"lookups_waited": 2, "lookups_late": 1}
