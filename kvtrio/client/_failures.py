"""What a worker adapter could not do: counted by cause, and said once per cause.

The engine never sees these failures (a store that could not be done is still reported
finished, so the engine frees its blocks; a failed retrieve reports its blocks for recompute),
so they must be visible elsewhere: in :meth:`Failures.snapshot` (``WorkerAdapter.metrics()``)
and in one log line per cause.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

__all__ = ["Failures"]

log = logging.getLogger("kvtrio.client")


class Failures:
    """Thread-safe counters of failed stores, retrieves and registrations."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stores: collections.Counter[str] = collections.Counter()
        self.retrieves: collections.Counter[str] = collections.Counter()
        self.registrations = 0
        self._warned: set[str] = set()

    def warn_once(self, cause: str, level: int, message: str, *args: object) -> None:
        """Log ``message`` the first time ``cause`` is seen (until :meth:`forget`)."""
        with self._lock:
            if cause in self._warned:
                return
            self._warned.add(cause)
        log.log(level, message, *args)

    def forget(self, prefix: str) -> None:
        """Causes starting with ``prefix`` are logged again the next time (e.g. once the
        registration succeeded, a later refusal is news)."""
        with self._lock:
            self._warned = {w for w in self._warned if not w.startswith(prefix)}

    def store(self, request_id: str, cause: str, chunks: int, detail: object = "") -> None:
        """A store (or ``chunks`` chunks of it) could not be done."""
        with self._lock:
            self.stores[cause] += chunks
        self.warn_once(
            f"store:{cause}",
            logging.WARNING,
            "kvtrio: a store of %s was not done (%s%s); further ones with this cause are only "
            "counted (WorkerAdapter.metrics())",
            request_id,
            cause,
            f": {detail}" if detail else "",
        )

    def retrieve(self, request_id: str, cause: str, chunks: int, detail: object = "") -> None:
        """``chunks`` chunks of a retrieve could not be loaded (the engine recomputes them)."""
        with self._lock:
            self.retrieves[cause] += chunks
        self.warn_once(
            f"retrieve:{cause}",
            logging.WARNING,
            "kvtrio: %d chunk(s) of %s's retrieve were not loaded (%s%s), the engine recomputes "
            "them; further ones with this cause are only counted (WorkerAdapter.metrics())",
            chunks,
            request_id,
            cause,
            f": {detail}" if detail else "",
        )

    def registration(self) -> None:
        with self._lock:
            self.registrations += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "registration_failures": self.registrations,
                "store_failures": dict(self.stores),
                "retrieve_failures": dict(self.retrieves),
            }
