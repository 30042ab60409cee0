"""How long vLLM's scheduler waits for a lookup's answer (``kvtrio.lookup_wait``): a policy,
no I/O.

A scheduling pass that waits ``w`` seconds for a new request's lookup holds up every request in
the engine by ``w`` (the step has not started); one that moves on costs that request a whole
step (it is asked about again at the next one). With steps of ``T`` seconds and ``n`` other
requests in the engine, that is the ski-rental problem with a rent of ``n + 1`` per second and a
purchase of ``T``: waiting up to ``T / (n + 1)``, then moving on, costs at most twice what the
best choice would, made knowing when the answer comes. An idle engine (``n = 0``) waits up to a
step; a full one hardly at all, as its next step comes soon for the few it makes wait.

That bound is for answers that come at the worst time. Answers come when they usually do: the
wait also covers 1.5 × the 90th percentile of the recent ones (a late answer counts as
endless), though never more than a step, after which the next step's pass is as early.
"""

from __future__ import annotations

import collections
import math

__all__ = ["LookupWait"]


class LookupWait:
    """The wait of each scheduling pass for a lookup's answer, and how often the answer came
    too late (``lookups_waited``, ``lookups_late``, for vLLM's stats line).

    ``fixed`` (seconds) overrides the rule; None (the default, ``auto``) applies it, between
    ``floor`` and ``cap``, with ``first`` before the engine's step time is known. Not
    thread-safe: the scheduler side calls it from its one thread."""

    COUNTERS = ("lookups_waited", "lookups_late")

    def __init__(
        self,
        fixed: float | None = None,
        *,
        floor: float = 0.001,
        cap: float = 0.5,
        first: float = 0.02,
    ) -> None:
        self.fixed = fixed
        self.floor = floor
        self.cap = cap
        self.first = first
        self.stats = dict.fromkeys(self.COUNTERS, 0)
        self._reported = self.stats.copy()
        self._answers: collections.deque[float] = collections.deque(maxlen=32)
        """How long the recent waits took until their answer (``inf``: it came after)."""

    def seconds(self, step_seconds: float, others: int) -> float:
        """How long to wait, with the engine's steps taking ``step_seconds`` (its recent median;
        0 if not known yet) and ``others`` other requests in the engine."""
        if self.fixed is not None:
            return self.fixed
        if step_seconds <= 0:
            return self.first
        usual = min(1.5 * self._usual(), step_seconds)
        return min(self.cap, max(self.floor, step_seconds / (1 + max(0, others)), usual))

    def _usual(self) -> float:
        """The 90th percentile of the recent waits' answers (0 before any)."""
        if not self._answers:
            return 0.0
        ordered = sorted(self._answers)
        return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]

    def waited(self, seconds: float, answered: bool) -> None:
        """Count a wait of ``seconds`` and whether the answer came within it."""
        self.stats["lookups_waited"] += 1
        self._answers.append(seconds if answered else math.inf)
        if not answered:
            self.stats["lookups_late"] += 1

    def since_last(self) -> dict[str, int]:
        """What the counters gained since the last call; {} if nothing."""
        delta = {name: self.stats[name] - self._reported[name] for name in self.COUNTERS}
        self._reported = self.stats.copy()
        return {name: value for name, value in delta.items() if value}
