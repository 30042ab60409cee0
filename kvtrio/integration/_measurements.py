"""A worker's side of ``load_policy=auto``: it times its forward steps and its L1 copies and
reports them to the scheduler side's :class:`~._costs.CostModel` (through vLLM's
worker-to-scheduler metadata). Time only: no vLLM here."""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["HookTime", "Measurements", "hook"]

F = TypeVar("F", bound=Callable[..., Any])


class HookTime:
    """The time an engine's thread spent inside the connector's hooks: what kvtrio costs the
    engine's step loop (its lookups and their waits, planning, queueing copies, in-step loads),
    summed until taken. Not thread-safe: vLLM calls each side's hooks from one thread."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def take(self) -> float:
        """The seconds summed since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def hook(method: F) -> F:
    """Time each call of a connector hook into its owner's ``hook_time`` (:class:`HookTime`),
    whatever the call returns or raises."""

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.hook_time.seconds += time.perf_counter() - started

    return cast(F, timed)


class Measurements:
    """A worker's side of ``load_policy=auto``: the time of its forward steps and of its
    loads of L1 chunks (the copy's own time, from the retrieve's submission to its end), as
    ``(tokens, seconds)``, until reported. Loads finish in the adapter's
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
