"""Heartbeat deadlines measured against the event loop's own progress (issue 22).

A session ends when its client has been silent for ``heartbeat_timeout``. Silent means: the
server could have heard from it and did not. While the event loop is stalled (a long message,
a slow system call, the machine swapping) nothing is heard from anyone, and the messages that
arrived meanwhile wait in the socket; a deadline in wall-clock time would end every session
whose deadline fell inside the stall, before the router reads the messages that prove the
client alive. So deadlines are kept in *progress time*: the loop's clock minus the time it was
stalled, as measured by one ticker task that wakes every ``tick`` seconds and counts how late
it woke. The same task ends the sessions whose deadline has passed in progress time, after
counting the stall it just woke from, so a session never expires for the loop's own delay.
(A stall is counted from the ticker's planned wake-up, so up to one ``tick`` of each stall
still counts as silence.)
"""

from __future__ import annotations

import heapq
import itertools
import logging
from typing import Protocol

import trio

from .._logging import event

__all__ = ["STALL_WARNING", "Heartbeats", "Watched"]

log = logging.getLogger("kvtrio.server")

STALL_WARNING = 1.0
"""A stall of the event loop at least this long is logged (a warning: no request should take it)."""


class Watched(Protocol):
    """What :class:`Heartbeats` needs of a session."""

    @property
    def heartbeat_deadline(self) -> float:
        """The session's current deadline, in progress time."""
        ...

    @property
    def ending(self) -> bool: ...

    def expire(self) -> None:
        """End the session: its client has been silent past its deadline."""
        ...


class Heartbeats:
    """The progress clock and the heartbeat deadlines of every session (one per server)."""

    def __init__(self, heartbeat_timeout: float) -> None:
        self.tick = min(heartbeat_timeout * 0.05, 0.25)
        """Seconds between two wake-ups of the ticker: expiry is at most this late."""
        self.stalled = 0.0
        """Seconds the loop has been stalled since the start (the ticker's lateness, summed)."""
        self.longest_stall = 0.0
        self._deadlines: list[tuple[float, int, Watched]] = []
        self._order = itertools.count()

    def progress(self, now: float) -> float:
        """Progress time at loop time ``now``: the time the loop was not stalled."""
        return now - self.stalled

    def watch(self, session: Watched) -> None:
        """Expire ``session`` once progress time passes its ``heartbeat_deadline`` (unless its
        deadline has moved by then: call again for each new deadline)."""
        entry = (session.heartbeat_deadline, next(self._order), session)
        heapq.heappush(self._deadlines, entry)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Tick until cancelled: count the loop's stalls, expire silent sessions. Cancellation:
        at its sleep; nothing to undo."""
        task_status.started()
        while True:
            planned = trio.current_time() + self.tick
            await trio.sleep_until(planned)
            now = trio.current_time()
            late = now - planned
            self.stalled += late
            self.longest_stall = max(self.longest_stall, late)
            if late >= STALL_WARNING:
                log.warning(
                    "the event loop was held for %.1f s (not counted against heartbeats)",
                    late,
                    extra=event("loop_stall", seconds=round(late, 3)),
                )
            self.expire(self.progress(now))

    def expire(self, progress: float) -> int:
        """End the sessions whose deadline is at or before ``progress``; how many."""
        deadlines = self._deadlines
        expired = 0
        while deadlines and deadlines[0][0] <= progress:
            deadline, _, session = heapq.heappop(deadlines)
            if session.heartbeat_deadline == deadline and not session.ending:
                session.expire()
                expired += 1
        return expired
