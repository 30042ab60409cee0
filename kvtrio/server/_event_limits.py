"""Rate limits of the KV events sockets (``_events``): token buckets per key and a log that
speaks at most once per interval."""

from __future__ import annotations

import logging
import time

__all__ = ["LOG_INTERVAL", "RateLog", "Rates"]

log = logging.getLogger("kvtrio.events")

LOG_INTERVAL = 10.0
"""Seconds between two lines of one :class:`RateLog`."""


class Rates:
    """A token bucket per key (ZAP user id): ``take(user)`` is False beyond the rate."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, user: str) -> bool:
        now = time.monotonic()
        tokens, then = self._buckets.get(user, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if len(self._buckets) > 4096:  # keys come from the allowed list; be safe anyway
            self._buckets.clear()
        if tokens < 1.0:
            self._buckets[user] = (tokens, now)
            return False
        self._buckets[user] = (tokens - 1.0, now)
        return True


class RateLog:
    """One log line per ``interval`` at most; the next says how many were not logged."""

    def __init__(self, interval: float = LOG_INTERVAL) -> None:
        self.interval = interval
        self._next = 0.0
        self._quiet = 0

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._quiet += 1
            return
        self._next = now + self.interval
        if self._quiet:
            message += " (and %d more not logged)"
            args = (*args, self._quiet)
            self._quiet = 0
        log.info(message, *args)
