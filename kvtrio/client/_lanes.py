"""The worker's transfer thread: one thread, two lanes. Loads (and registration work) go first;
stores wait until no load is queued.

A load stands between a request and its first token; a store is for later requests. In one
FIFO thread a hit's load waited behind every store queued by the steps before it (a whole
prefill's chunks), which the load policy then counted as the load's own time. Reordering is
safe: a load writes into blocks just allocated to its request, and vLLM holds a request's blocks
until its stores are done (a preempted one's too, :meth:`~._worker_side.WorkerSide.preemptions`
waits), so no queued store reads blocks a load writes; within a lane, order is kept.

Loads overtake a waiting store a bounded number of times (``overtakes``, 8): a steady stream of
hits (one load per hit request) would otherwise hold stores back for as long as it lasts, and
with them the blocks vLLM keeps until a request's stores are done, and the chunks later hits
would find. A load then waits for at most one store.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

__all__ = ["TransferLanes"]

log = logging.getLogger("kvtrio.client")


class TransferLanes(Executor):
    """One worker thread running calls in two lanes: those of :meth:`submit` in order, before
    any of :meth:`submit_later`'s, which run in order when the first lane is empty, or when
    ``overtakes`` calls of the first lane in a row ran while the second one's next call waited.

    Otherwise a one-thread :class:`~concurrent.futures.ThreadPoolExecutor`: a submit returns a
    future of the call's result and raises ``RuntimeError`` after :meth:`shutdown`, which lets
    what is queued run (and with ``wait`` joins the thread). ``initializer`` runs first in the
    thread."""

    def __init__(
        self,
        name: str,
        initializer: Callable[[], object] | None = None,
        *,
        overtakes: int = 8,
    ) -> None:
        if overtakes < 1:
            raise ValueError(f"overtakes must be at least 1, not {overtakes}")
        self._overtakes = overtakes
        self._overtaken = 0
        """Calls of the first lane run in a row while the second lane's next call waited."""
        self._lanes: tuple[collections.deque[_Item], collections.deque[_Item]] = (
            collections.deque(),
            collections.deque(),
        )
        self._ready = threading.Condition()
        self._closed = False
        self._initializer = initializer
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Queue ``fn(*args, **kwargs)`` in the first lane; its future."""
        return self._queue(0, fn, args, kwargs)

    def submit_later(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Queue ``fn(*args, **kwargs)`` in the second lane; its future."""
        return self._queue(1, fn, args, kwargs)

    def _queue(
        self, lane: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Future[Any]:
        future: Future[Any] = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("cannot submit after shutdown")
            self._lanes[lane].append((future, fn, args, kwargs))
            self._ready.notify()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new calls; the queued ones still run (``cancel_futures``: are cancelled).
        With ``wait``, return once they have."""
        with self._ready:
            self._closed = True
            if cancel_futures:
                for lane in self._lanes:
                    for future, *_ in lane:
                        future.cancel()
            self._ready.notify()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        if self._initializer is not None:
            try:
                self._initializer()  # (placement: logs a refusal, never raises)
            except Exception:  # the calls still run, where the thread is
                log.exception("initializing the thread %s failed", self._thread.name)
        while True:
            with self._ready:
                while not (self._lanes[0] or self._lanes[1] or self._closed):
                    self._ready.wait()
                first, second = self._lanes
                if second and (not first or self._overtaken >= self._overtakes):
                    lane, self._overtaken = second, 0
                elif first:
                    lane = first
                    self._overtaken += 1 if second else 0
                else:
                    return  # closed, nothing left
                future, fn, args, kwargs = lane.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the future, as an executor does
                future.set_exception(exc)
            else:
                future.set_result(result)


_Item = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]
