"""What a worker reports back to its engine: the engine requests whose stores and retrieves are
done, and the blocks whose loads failed, by vLLM's rules. No I/O.

vLLM's rules: a request's stores are reported done only once the engine has also reported the
request finished (its blocks are held until then), and all its stores are done; its retrieves
once all of them are. Blocks whose retrieve failed are reported once, for the engine to
recompute.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable
from concurrent.futures import Future

__all__ = ["Completions"]


class Completions:
    """The worker's transfers of each engine request, from submitted to reported.

    Thread-safe: the engine's step loop submits and asks (:meth:`finished`), the transfer
    thread and the client's I/O thread (a store's commits answered) end transfers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending_stores: collections.Counter[str] = collections.Counter()
        self._open_stores: set[Future[None]] = set()
        """Stores submitted whose commits are not answered yet."""
        self._pending_retrieves: collections.Counter[str] = collections.Counter()
        self._stored: set[str] = set()
        """Requests with a store submitted and not reported yet."""
        self._engine_finished: set[str] = set()
        self._retrieves_done: set[str] = set()
        self._failed_blocks: set[int] = set()

    def store_submitted(self, request_id: str, done: Future[None]) -> None:
        """A store of ``request_id`` is submitted; ``done`` is its future."""
        with self._lock:
            self._pending_stores[request_id] += 1
            self._stored.add(request_id)
            self._open_stores.add(done)

    def store_ended(self, request_id: str, done: Future[None]) -> None:
        """That store is over (its commits answered, or it failed): it counts as done, and
        ``done`` is set (any thread)."""
        with self._lock:
            self._pending_stores[request_id] -= 1
            self._open_stores.discard(done)
        done.set_result(None)

    def open_stores(self) -> list[Future[None]]:
        """The futures of the stores not over yet (to wait for at shutdown)."""
        with self._lock:
            return list(self._open_stores)

    def retrieve_submitted(self, request_id: str) -> None:
        with self._lock:
            self._pending_retrieves[request_id] += 1

    def retrieve_not_run(self, request_id: str) -> None:
        """A retrieve counted by :meth:`retrieve_submitted` will not run (shut down)."""
        with self._lock:
            self._pending_retrieves[request_id] -= 1

    def retrieve_ended(self, request_id: str, failed_blocks: Iterable[int]) -> None:
        """A retrieve of ``request_id`` is over; ``failed_blocks``: the engine blocks it could
        not load. The request's retrieves are done once none is pending."""
        with self._lock:
            self._failed_blocks.update(failed_blocks)
            self._pending_retrieves[request_id] -= 1
            if not self._pending_retrieves[request_id]:
                del self._pending_retrieves[request_id]
                self._retrieves_done.add(request_id)

    def finished(self, finished_by_engine: Iterable[str]) -> tuple[set[str], set[str]]:
        """``(stores done, retrieves done)`` since the last call, ``finished_by_engine`` being
        the requests the engine reports finished now."""
        with self._lock:
            self._engine_finished.update(r for r in finished_by_engine if r in self._stored)
            stores = {r for r in self._engine_finished if not self._pending_stores[r]}
            for request_id in stores:
                self._engine_finished.discard(request_id)
                self._stored.discard(request_id)
                del self._pending_stores[request_id]
            retrieves, self._retrieves_done = self._retrieves_done, set()
        return stores, retrieves

    def failed_blocks(self) -> set[int]:
        """Engine blocks whose retrieve failed since the last call."""
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed
