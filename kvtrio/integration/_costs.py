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
* **load**: ``fixed + per_token × tokens``, a least-squares line through the last loads (from
  the step that handed a load to the workers to the step that reported it done).

:meth:`CostModel.worth_loading` says yes while either cost is unknown (the first loads teach
it), and no when the load would take longer than computing the same tokens. A hit that does not
pay is still loaded now and then (every ``explore_every``-th), so the model follows a changing
machine (an L2 that became fast, a cache that warmed up). Time and counters only: no vLLM here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import statistics
import time

import attrs

__all__ = ["CostModel", "LoadDecision", "LoadPolicy", "Measurements"]

log = logging.getLogger("kvtrio.vllm")


@attrs.frozen
class LoadDecision:
    """A decision on one hit: load it or not, and the estimates behind it (seconds; None if
    unknown)."""

    load: bool
    load_seconds: float | None
    compute_seconds: float | None
    explored: bool = False
    """Loaded although it does not pay, to measure loading again."""


@attrs.define
class CostModel:
    """Costs of loading and computing, from this engine's own steps and loads (see the
    module docstring). Not thread-safe: the scheduler side calls it from its one thread."""

    min_step_tokens: int = 64
    """Steps with fewer scheduled tokens (decode) do not teach the compute cost."""
    window: int = 32
    """Samples kept of each kind."""
    explore_every: int = 16
    """One in this many hits that do not pay is loaded anyway."""
    _steps: collections.deque[float] = attrs.field(init=False)
    _loads: collections.deque[tuple[int, float]] = attrs.field(init=False)
    _skipped_in_a_row: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._steps = collections.deque(maxlen=self.window)
        self._loads = collections.deque(maxlen=self.window)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` tokens in ``seconds``."""
        if tokens >= self.min_step_tokens and seconds > 0:
            self._steps.append(seconds / tokens)

    def observe_load(self, tokens: int, seconds: float) -> None:
        """A load of ``tokens`` tokens took ``seconds``, as the request waited for it."""
        if tokens > 0 and seconds >= 0:
            self._loads.append((tokens, seconds))

    def compute_seconds(self, tokens: int) -> float | None:
        """What computing ``tokens`` tokens costs (None: no prefill step seen yet)."""
        if not self._steps:
            return None
        return statistics.median(self._steps) * tokens

    def load_seconds(self, tokens: int) -> float | None:
        """What loading ``tokens`` tokens costs (None: no load seen yet)."""
        if not self._loads:
            return None
        fixed, per_token = self._load_line()
        return fixed + per_token * tokens

    def _load_line(self) -> tuple[float, float]:
        """``(fixed, per_token)`` seconds: least squares through the loads, both ≥ 0; with
        loads of one size only, the median time split as all per-token cost."""
        sizes = [float(t) for t, _ in self._loads]
        times = [s for _, s in self._loads]
        if len(set(sizes)) < 2:
            return 0.0, statistics.median(s / t for t, s in zip(sizes, times, strict=True))
        slope, intercept = statistics.linear_regression(sizes, times)
        if slope < 0:  # noise: fall back to the mean rate
            return 0.0, sum(times) / sum(sizes)
        if intercept < 0:
            return 0.0, statistics.median(s / t for t, s in zip(sizes, times, strict=True))
        return intercept, slope

    def worth_loading(self, tokens: int) -> LoadDecision:
        """Whether loading ``tokens`` tokens beats computing them."""
        load, compute = self.load_seconds(tokens), self.compute_seconds(tokens)
        if load is None or compute is None or load < compute:
            self._skipped_in_a_row = 0
            return LoadDecision(True, load, compute)
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row >= self.explore_every:
            self._skipped_in_a_row = 0
            return LoadDecision(True, load, compute, explored=True)
        return LoadDecision(False, load, compute)


class LoadPolicy:
    """The scheduler side's ``kvtrio.load_policy``: ``always`` loads every hit, ``auto`` only
    the hits that :class:`CostModel` says pay. :attr:`stats` keeps the account."""

    def __init__(self, policy: str, model: CostModel) -> None:
        self.policy = policy
        self.model = model
        self.stats: collections.Counter[str] = collections.Counter()
        """``loads``, ``skipped`` (hits computed as loading is slower), ``skipped_tokens``,
        ``explored``, ``saved_ms`` (estimated: compute minus load, loads with both known)."""

    def load(self, request_id: str, tokens: int) -> bool:
        """Whether to load ``tokens`` tokens of request ``request_id``."""
        if self.policy == "always":
            self.stats["loads"] += 1
            return True
        decision = self.model.worth_loading(tokens)
        load, compute = decision.load_seconds, decision.compute_seconds
        if decision.load:
            self.stats["loads"] += 1
            self.stats["explored"] += decision.explored
            if load is not None and compute is not None:
                self.stats["saved_ms"] += round(max(0.0, compute - load) * 1e3)
            return True
        self.stats["skipped"] += 1
        self.stats["skipped_tokens"] += tokens
        level = logging.INFO if self.stats["skipped"] == 1 else logging.DEBUG
        log.log(
            level,
            "kvtrio: a hit of %d tokens (request %s) is computed, not loaded: loading takes "
            "~%.1f ms, computing ~%.1f ms here (kvtrio.load_policy=always loads every hit)",
            tokens, request_id, (load or 0.0) * 1e3, (compute or 0.0) * 1e3,
        )  # fmt: skip
        return False


class Measurements:
    """A worker's side of ``load_policy=auto``: the time of its forward steps and of its
    asynchronous loads, as ``(tokens, seconds)``, until reported. Loads finish in the adapter's
    transfer thread: the deques are appended to from there (atomic in CPython)."""

    def __init__(self) -> None:
        self.steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=64)
        self.loads: collections.deque[tuple[int, float]] = collections.deque(maxlen=64)
        self._step: tuple[float, int] | None = None

    def step_started(self, tokens: int) -> None:
        """The step's forward (of ``tokens`` tokens) starts now."""
        self._step = (time.perf_counter(), tokens) if tokens > 0 else None

    def step_done(self) -> None:
        """The step's forward is done."""
        if self._step is not None:
            started, tokens = self._step
            self.steps.append((tokens, time.perf_counter() - started))
            self._step = None

    def time_load(self, tokens: int, future: concurrent.futures.Future[None]) -> None:
        """Measure a load of ``tokens`` tokens from now until ``future`` is done."""
        started = time.perf_counter()
        future.add_done_callback(
            lambda _: self.loads.append((tokens, time.perf_counter() - started))
        )

    def report(self) -> tuple[list[tuple[int, float]], list[tuple[int, float]]] | None:
        """``(steps, loads)`` measured since the last report; None if nothing was."""
        if not self.steps and not self.loads:
            return None
        steps = [self.steps.popleft() for _ in range(len(self.steps))]
        loads = [self.loads.popleft() for _ in range(len(self.loads))]
        return steps, loads
