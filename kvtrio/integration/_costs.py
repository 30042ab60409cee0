"""Whether a hit pays: what loading costs next to what computing costs, learnt online.

An engine's scheduler side decides, per request, whether to load what kvtrio holds or compute
it again. Loading is not free: a round trip or two, a copy of every byte, and (asynchronous
loads) a step or more of waiting; computing costs the engine's own prefill time. For big models
and long prompts loading wins by far; for tiny models, short hits or a slow L2 it can lose, and
then a user would be better off without kvtrio. :class:`CostModel` keeps both costs as this
engine measures them, no calibration run needed:

* **compute**: seconds per token of the engine's prefill steps (the time from a step's
  scheduling to its output, over the tokens it scheduled; only steps with at least
  ``min_step_tokens`` tokens count, so decode steps do not inflate it);
* **load**, per tier (``l1``: every chunk in the server's L1; ``l2``: some chunks come from its
  L2 backends first): ``fixed + per_token × (tokens + queued)``, a least-squares line through
  the tier's last loads, where ``queued`` are the tokens of the tier's loads still in flight
  when the load started (loads in flight share the memory bus, the disk, the network: a load
  queued behind others takes longer, and the line learns by how much).

A hit is judged where it waits (:meth:`CostModel.decide`), with what the scheduler sees then:
the loads in flight per tier, the engine's prefill **backlog** (prompt tokens it has yet to
compute for the requests it runs, ahead of this one) and the **other requests** it serves. With
``c`` the compute seconds per token, ``B`` the backlog, ``N`` the hit's tokens, ``r`` the
prompt's tokens after the hit and ``S`` a step of the engine (the median of its forward steps),
both ways end with the request's own prefill step, ``S + r·c`` (the *tail*):

* **compute**: ``B·c + N·c + tail``; and every one of the ``M`` other requests waits ``N·c``
  longer for its next step (a prefill on the engine's cores delays the whole batch), so the
  cost counted is ``B·c + N·c·(1 + M) + tail``;
* **load**: ``max(L, B·c) + tail``, with ``L`` the load's time as the scheduler sees it (from
  the step that hands it out to the step that reports it done: a load lands at a step
  boundary); the copy runs on kvtrio's own threads, off the engine's cores, so the others do
  not wait for it. A load that finishes while the request would still be queued costs
  nothing;
* **split**: the L1 part loaded, the L2 part (``N₂`` tokens) computed:
  ``max(L₁, B·c) + N₂·c·(1 + M) + tail``.

``B`` counts only the engine's **whole steps** of backlog (``step_budget``: vLLM's
``max_num_batched_tokens``): vLLM schedules the running requests' prefill chunks first and this
request with what is left of the step's token budget, so a backlog smaller than one step's
budget delays it by nothing, and an asynchronous load (which lands a step later at least) is
then not hidden behind it (counted token by token, a busy engine's backlog made every load
between steps look free: 0 of 151 hits were loaded inside the step at 8 requests/s with 16
running slots, ``docs/vllm.md`` §12).

The cheapest wins (computing on a tie). With ``M = 0`` this is the request's own time to its
first token; under a served load (``M`` large) a computed hit is paid by every request in the
engine, which is why loads that are a step slower for one request still serve more.

While a cost is unknown the hit is loaded (the first loads teach it). A hit that does not pay
is still loaded now and then (``explore_every``-th skip), so the model follows a changing
machine (an L2 that became fast, a cache that warmed up); an exploration that turns out slower
doubles the gap to the next (up to ``max_explore_every``), one that pays resets it.
:class:`LoadPolicy` counts the decisions and their **regret**: afterwards, the measured cost of
the choice against the estimate of the alternative, in the same terms (a load: its measured time
plus the tail; a computed hit: the measured time from the decision until its tokens were computed,
its own step included, plus the others' wait, which is estimated: ``M·N·c``). Time and counters
only: no vLLM here.
"""

from __future__ import annotations

import collections
import json
import logging
import statistics
from typing import Literal

import attrs

__all__ = ["CostModel", "LoadDecision", "LoadPolicy", "Tier"]

log = logging.getLogger("kvtrio.vllm")

Tier = Literal["l1", "l2"]
SkipReason = Literal["slower", "contention", "idle"]


@attrs.frozen
class LoadDecision:
    """A decision on one hit: how many of its tokens to load (0: compute them all; the L1 part:
    a split; all), and the estimates behind it (seconds from now until the hit's tokens are in
    the engine, the request's own rest left out; None if unknown)."""

    tokens: int
    """Tokens to load, the leading ones of the hit."""
    load_seconds: float | None
    """The load of the whole hit (its tier, the loads in flight included)."""
    compute_seconds: float | None
    """Computing the hit, behind the engine's backlog."""
    split: bool = False
    """Only the hit's L1 part is loaded; the L2 part is computed."""
    explored: bool = False
    """Loaded although it does not pay, to measure loading again."""
    in_step: bool = False
    """Loaded inside the request's first step, before its forward (a short L1 load: the
    batch waits for the copy, the request saves the step an asynchronous load lands after)."""
    reason: SkipReason | None = None
    """Why nothing is loaded: ``slower`` (the load takes longer than the engine's queue and
    the prefill), ``contention`` (it would pay without the loads in flight), ``idle`` (the
    engine has nothing queued: it computes the hit at once)."""
    chosen_seconds: float | None = None
    """The estimate of what was chosen."""
    alternative_seconds: float | None = None
    """The estimate of the best other choice (what regret compares with)."""
    wait_seconds: float = 0.0
    """``B·c``: a load shorter than this is hidden behind the engine's backlog."""
    rest_seconds: float = 0.0
    """A split's computing of the L2 part, the others' wait for it included."""
    tail_seconds: float = 0.0
    """``S + r·c``: the request's own prefill step after the hit, the same either way (taken
    off a computed hit's measured time when it is judged)."""
    others_seconds: float = 0.0
    """``M·N·c``: what computing the hit makes the other requests wait (added to a computed
    hit's measured time when it is judged)."""

    @property
    def load(self) -> bool:
        return self.tokens > 0


class _Line:
    """One tier's load line: ``(fixed, per_token)`` through its last loads, fitted once per new
    sample (not per decision)."""

    def __init__(self, window: int) -> None:
        self.samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self._fit: tuple[float, float] | None = None

    def add(self, x: int, seconds: float) -> None:
        self.samples.append((x, seconds))
        self._fit = None

    def seconds(self, x: int) -> float | None:
        if not self.samples:
            return None
        fit = self._fit
        if fit is None:
            fit = self._fit = self._line()
        return fit[0] + fit[1] * x

    def _line(self) -> tuple[float, float]:
        """Least squares, both terms ≥ 0; with loads of one size only, the median time split
        as all per-token cost."""
        sizes = [float(t) for t, _ in self.samples]
        times = [s for _, s in self.samples]
        if len(set(sizes)) < 2:
            return 0.0, statistics.median(s / t for t, s in zip(sizes, times, strict=True))
        slope, intercept = statistics.linear_regression(sizes, times)
        if slope < 0:  # noise: fall back to the mean rate
            return 0.0, sum(times) / sum(sizes)
        if intercept < 0:
            return 0.0, statistics.median(s / t for t, s in zip(sizes, times, strict=True))
        return intercept, slope


@attrs.define
class CostModel:
    """Costs of loading and computing, from this engine's own steps and loads (see the
    module docstring). Not thread-safe: the scheduler side calls it from its one thread."""

    min_step_tokens: int = 64
    """Steps with fewer scheduled tokens (decode) do not teach the compute cost."""
    window: int = 32
    """Samples kept of each kind."""
    explore_every: int = 16
    """One in this many hits that do not pay is loaded anyway (at first)."""
    max_explore_every: int = 256
    """The gap between explorations grows up to this while they turn out slower."""
    step_budget: int | None = None
    """Tokens the engine schedules per step (vLLM's ``max_num_batched_tokens``): only whole
    steps of backlog delay a request (None: every token of it does)."""
    _steps: collections.deque[float] = attrs.field(init=False)
    _per_token: float | None = attrs.field(init=False, default=None)
    _durations: collections.deque[float] = attrs.field(init=False)
    _copy: _Line = attrs.field(init=False)
    _step: float | None = attrs.field(init=False, default=None)
    _lines: dict[str, _Line] = attrs.field(init=False)
    _skipped_in_a_row: int = attrs.field(init=False, default=0)
    _explore_gap: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._steps = collections.deque(maxlen=self.window)
        self._durations = collections.deque(maxlen=self.window)
        self._copy = _Line(self.window)
        self._lines = {"l1": _Line(self.window), "l2": _Line(self.window)}
        self._explore_gap = self.explore_every

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` tokens in ``seconds``."""
        if tokens > 0 and seconds > 0:
            self._durations.append(seconds)
            self._step = None
        if tokens >= self.min_step_tokens and seconds > 0:
            self._steps.append(seconds / tokens)
            self._per_token = None

    def step_seconds(self) -> float:
        """The median of the engine's recent forward steps (0 before the first)."""
        if self._step is None:
            self._step = statistics.median(self._durations) if self._durations else 0.0
        return self._step

    def observe_load(self, tokens: int, seconds: float, tier: Tier = "l1", queued: int = 0) -> None:
        """A load of ``tokens`` tokens from ``tier`` took ``seconds`` as the request waited for
        it, started behind ``queued`` tokens of the tier's loads in flight."""
        if tokens > 0 and seconds >= 0:
            self._lines[tier].add(tokens + max(0, queued), seconds)

    def observe_copy(self, tokens: int, seconds: float) -> None:
        """A worker copied ``tokens`` tokens of L1 chunks in ``seconds`` (the retrieve's own
        time, not waiting for a step)."""
        if tokens > 0 and seconds >= 0:
            self._copy.add(tokens, seconds)

    def copy_seconds(self, tokens: int) -> float | None:
        """What a worker's copy of ``tokens`` L1 tokens costs (None: none timed yet)."""
        return self._copy.seconds(tokens)

    def compute_seconds(self, tokens: int) -> float | None:
        """What computing ``tokens`` tokens costs (None: no prefill step seen yet)."""
        per_token = self.per_token()
        return None if per_token is None else per_token * tokens

    def per_token(self) -> float | None:
        """The median prefill seconds per token (None: no prefill step seen yet)."""
        if self._per_token is None and self._steps:
            self._per_token = statistics.median(self._steps)
        return self._per_token

    def load_seconds(self, tokens: int, tier: Tier = "l1", queued: int = 0) -> float | None:
        """What loading ``tokens`` tokens from ``tier`` costs behind ``queued`` tokens of
        loads in flight (None: no load of the tier seen yet)."""
        return self._lines[tier].seconds(tokens + queued)

    def worth_loading(self, tokens: int) -> LoadDecision:
        """Whether loading ``tokens`` L1 tokens beats computing them, alone on an idle engine."""
        return self.decide(tokens, tokens)

    def decide(
        self,
        tokens: int,
        l1_tokens: int,
        *,
        queued_l1: int = 0,
        queued_l2: int = 0,
        backlog: int = 0,
        rest: int = 0,
        others: int = 0,
    ) -> LoadDecision:
        """What to load of a hit of ``tokens`` tokens whose first ``l1_tokens`` are in L1,
        with ``queued_l1`` / ``queued_l2`` tokens of loads in flight per tier, ``backlog``
        prefill tokens ahead of it in the engine, ``rest`` prompt tokens after the hit and
        ``others`` other requests in the engine (see the module docstring). A few float
        operations: the lines and medians are refitted when a sample comes, not here."""
        l1 = max(0, min(l1_tokens, tokens))
        l2 = tokens - l1
        tier: Tier = "l2" if l2 else "l1"
        queued = queued_l2 if l2 else queued_l1
        load = self._lines[tier].seconds(tokens + queued)
        per_token = self.per_token()
        if load is None or per_token is None:
            self._skipped_in_a_row = 0
            return LoadDecision(tokens, load, None if per_token is None else per_token * tokens)
        shared = 1 + max(0, others)
        wait = self.waited(backlog) * per_token
        tail = self.step_seconds() + max(0, rest) * per_token
        others_wait = (shared - 1) * tokens * per_token
        compute = wait + tokens * per_token + others_wait
        full = max(load, wait)
        in_step = False
        copy = None if l2 else self._copy.seconds(tokens + queued_l1)
        in_step_others = 0.0
        if copy is not None and wait + shared * copy < full:
            # Inside the request's first step: the whole batch waits for the copy, and the
            # request starts its step at once instead of a step later.
            full, in_step, in_step_others = wait + shared * copy, True, (shared - 1) * copy
        split = rest_l2 = None
        if l1 and l2:
            l1_load = self._lines["l1"].seconds(l1 + queued_l1)
            if l1_load is not None:
                rest_l2 = l2 * per_token * shared
                split = max(l1_load, wait) + rest_l2
        if full < compute and (split is None or full <= split):
            self._skipped_in_a_row = 0
            other = compute if split is None else min(compute, split)
            return LoadDecision(tokens, load, compute, chosen_seconds=full, in_step=in_step,
                                alternative_seconds=other, wait_seconds=wait,
                                tail_seconds=tail, others_seconds=in_step_others)  # fmt: skip
        if split is not None and rest_l2 is not None and split < compute:
            self._skipped_in_a_row = 0
            return LoadDecision(l1, load, compute, split=True, chosen_seconds=split,
                                alternative_seconds=min(compute, full), wait_seconds=wait,
                                rest_seconds=rest_l2)  # fmt: skip
        best_load = full if split is None else min(full, split)
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row >= self._explore_gap:
            self._skipped_in_a_row = 0
            return LoadDecision(tokens, load, compute, explored=True, chosen_seconds=full,
                                alternative_seconds=compute, wait_seconds=wait)  # fmt: skip
        reason: SkipReason = "idle" if backlog <= 0 and others <= 0 else "slower"
        if queued or (rest_l2 is not None and queued_l1):  # would it pay with no load in flight?
            alone = self._lines[tier].seconds(tokens)
            alone_l1 = self._lines["l1"].seconds(l1) if rest_l2 is not None else None
            if (alone is not None and max(alone, wait) < compute) or (
                alone_l1 is not None
                and rest_l2 is not None
                and max(alone_l1, wait) + rest_l2 < compute
            ):
                reason = "contention"
        return LoadDecision(0, load, compute, reason=reason, chosen_seconds=compute,
                            alternative_seconds=best_load, wait_seconds=wait,
                            tail_seconds=tail, others_seconds=others_wait)  # fmt: skip

    def waited(self, backlog: int) -> int:
        """Of ``backlog`` prefill tokens ahead, those the request waits for: whole steps of
        ``step_budget`` tokens (all of them without a budget)."""
        backlog = max(0, backlog)
        budget = self.step_budget
        return backlog if not budget or budget <= 0 else backlog - backlog % budget

    def explored(self, paid: bool) -> None:
        """An exploration's outcome: one that paid resets the gap between explorations, one
        that did not doubles it (up to ``max_explore_every``)."""
        if paid:
            self._explore_gap = self.explore_every
        else:
            self._explore_gap = min(self.max_explore_every, self._explore_gap * 2)


class LoadPolicy:
    """The scheduler side's ``kvtrio.load_policy``: ``always`` loads every hit, ``auto`` what
    :class:`CostModel` says pays. :attr:`stats` keeps the account, regret included: each
    decision's measured outcome (:meth:`load_measured`, :meth:`compute_measured`) against its
    alternative's estimate at the time."""

    def __init__(self, policy: str, model: CostModel) -> None:
        self.policy = policy
        self.model = model
        self.stats: collections.Counter[str] = collections.Counter()
        """``loads`` (hits loaded, whole or split), ``split`` (of them, the L1 part only),
        ``skipped`` (hits computed) and ``skipped_slower`` / ``skipped_contention`` /
        ``skipped_idle`` by reason, ``skipped_tokens``, ``explored``, ``saved_ms`` (estimated:
        computing minus the choice, loads with both known), ``judged`` (decisions measured
        afterwards), ``regret`` (of them, the choice turned out slower than the alternative's
        estimate: ``regret_loads``, ``regret_skips``, ``regret_explored`` of those explored)
        and ``regret_ms`` (by how much, summed)."""
        self._pending: dict[str, LoadDecision] = {}
        """Decisions waiting for their measurement, by request."""
        self._reported: collections.Counter[str] = collections.Counter()

    def since_last(self) -> dict[str, int]:
        """What the counters gained since the last call (the first: since the start); {} if
        nothing. For vLLM's periodic stats, which sum these per interval."""
        if self.stats == self._reported:
            return {}
        delta = {name: self.stats[name] - self._reported[name] for name in self.COUNTERS}
        self._reported = self.stats.copy()
        return {name: value for name, value in delta.items() if value}

    def load(self, request_id: str, tokens: int) -> bool:
        """Whether to load ``tokens`` L1 tokens of request ``request_id`` (idle engine, no
        loads in flight)."""
        return self.decide(request_id, tokens, tokens).load

    def decide(
        self,
        request_id: str,
        tokens: int,
        l1_tokens: int,
        *,
        queued_l1: int = 0,
        queued_l2: int = 0,
        backlog: int = 0,
        rest: int = 0,
        others: int = 0,
    ) -> LoadDecision:
        """What to load of request ``request_id``'s hit (see :meth:`CostModel.decide`); the
        decision is counted and kept for its measurement."""
        if self.policy == "always":
            self.stats["loads"] += 1
            return LoadDecision(tokens, None, None)
        decision = self.model.decide(tokens, l1_tokens, queued_l1=queued_l1,
                                     queued_l2=queued_l2, backlog=backlog, rest=rest,
                                     others=others)  # fmt: skip
        if decision.alternative_seconds is not None:
            self._pending[request_id] = decision
        if decision.load:
            self.stats["loads"] += 1
            if decision.split:
                self.stats["split"] += 1
            if decision.in_step:
                self.stats["in_step"] += 1
            if decision.explored:
                self.stats["explored"] += 1
            if decision.chosen_seconds is not None and decision.compute_seconds is not None:
                saved = decision.compute_seconds - decision.chosen_seconds
                self.stats["saved_ms"] += round(max(0.0, saved) * 1e3)
            return decision
        self.stats["skipped"] += 1
        self.stats[f"skipped_{decision.reason}"] += 1
        self.stats["skipped_tokens"] += tokens
        level = logging.INFO if self.stats["skipped"] == 1 else logging.DEBUG
        log.log(
            level,
            "kvtrio: a hit of %d tokens (request %s) is computed, not loaded (%s): loading "
            "takes ~%.1f ms, computing ~%.1f ms here (kvtrio.load_policy=always loads every "
            "hit)",
            tokens, request_id, decision.reason, (decision.load_seconds or 0.0) * 1e3,
            (decision.compute_seconds or 0.0) * 1e3,
        )  # fmt: skip
        return decision

    def load_measured(self, request_id: str, seconds: float) -> None:
        """Request ``request_id``'s load between steps took ``seconds``: judge its decision."""
        decision = self._pending.get(request_id)
        if decision is None or not decision.load or decision.in_step:
            return
        del self._pending[request_id]
        actual = max(seconds, decision.wait_seconds) + decision.rest_seconds
        self._judge(decision, actual, "regret_loads")

    def compute_measured(self, request_id: str, seconds: float) -> None:
        """Request ``request_id``'s hit was in the engine ``seconds`` after it was decided, the
        step that computed it (or loaded it inside the step) included: judge its decision. A
        load between steps lands before the request's own prefill step, so that step's
        estimate (the tail) is taken off the measured time, and the others' estimated wait
        (for the computed hit, or for the copy inside their step) added."""
        decision = self._pending.get(request_id)
        if decision is None or (decision.load and not decision.in_step):
            return
        del self._pending[request_id]
        actual = max(0.0, seconds - decision.tail_seconds) + decision.others_seconds
        self._judge(decision, actual, "regret_loads" if decision.load else "regret_skips")

    def _judge(self, decision: LoadDecision, actual: float, kind: str) -> None:
        alternative = decision.alternative_seconds
        assert alternative is not None  # (only such decisions are kept)
        self.stats["judged"] += 1
        regret = actual > alternative
        if decision.explored:
            self.model.explored(paid=not regret)
        if regret:
            self.stats["regret"] += 1
            self.stats[kind] += 1
            if decision.explored:
                self.stats["regret_explored"] += 1
            self.stats["regret_ms"] += round((actual - alternative) * 1e3)

    def forget(self, request_id: str) -> None:
        """The request ended before its decision could be measured."""
        self._pending.pop(request_id, None)

    def pending(self, request_id: str) -> LoadDecision | None:
        """The decision on ``request_id``'s hit still waiting for its measurement."""
        return self._pending.get(request_id)

    COUNTERS = (
        "loads", "split", "in_step", "explored", "saved_ms", "skipped", "skipped_slower",
        "skipped_contention", "skipped_idle", "skipped_tokens", "judged", "regret",
        "regret_loads", "regret_skips", "regret_explored", "regret_ms",
    )  # fmt: skip
    """Every counter of :attr:`stats`, in :meth:`summary`'s order."""

    def summary(self) -> str:
        """The counters as one JSON object, every one of :data:`COUNTERS` (zeros too)."""
        return json.dumps({name: self.stats[name] for name in self.COUNTERS})
