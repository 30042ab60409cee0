"""The bench's scheduler side: requests through lookup → retrieve → store → end, in trio.

One trio task per request in flight. Blocking pieces (the scheduler adapter's wait for a lookup,
pipe I/O with the worker processes) run in threads under named capacity limiters.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import trio

from ..client import SchedulerAdapter
from ._options import BenchError, BenchOptions
from ._results import BenchResult, RequestRecord
from ._workload import BenchRequest, Workload

__all__ = ["BlockPool", "Driver"]


class BlockPool:
    """The engine's free KV blocks (the same block ids on every rank); first come, first served."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._free = np.arange(total, dtype=np.int32)
        self._count = total
        self._lock = trio.Lock()
        self._changed = trio.Event()

    async def take(self, n: int) -> np.ndarray[Any, Any]:
        async with self._lock:  # one waiter at a time: FIFO, no starvation of large requests
            while self._count < n:
                self._changed = trio.Event()
                await self._changed.wait()
            blocks: np.ndarray[Any, Any] = self._free[self._count - n : self._count].copy()
            self._count -= n
            return blocks

    def give(self, blocks: np.ndarray[Any, Any]) -> None:
        self._free[self._count : self._count + len(blocks)] = blocks
        self._count += len(blocks)
        self._changed.set()


class _Rank:
    """The pipe to one worker process: commands out in order, replies dispatched by request."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn = conn
        self.rank = rank
        self.send_limiter = trio.CapacityLimiter(1)
        self.recv_limiter = trio.CapacityLimiter(1)

    async def send(self, command: tuple[Any, ...]) -> None:
        await trio.to_thread.run_sync(self.conn.send, command, limiter=self.send_limiter)


class Driver:
    """Runs a workload once through a scheduler adapter and the worker processes."""

    def __init__(
        self,
        options: BenchOptions,
        workload: Workload,
        scheduler: SchedulerAdapter,
        conns: list[Connection],
        blocks: int,
        chunk_size: int,
        result: BenchResult,
    ) -> None:
        self.options = options
        self.workload = workload
        self.scheduler = scheduler
        self.ranks = [_Rank(conn, rank) for rank, conn in enumerate(conns)]
        self.pool = BlockPool(blocks)
        self.chunk = chunk_size
        self.result = result
        self.prefix = f"bench-{uuid.uuid4().hex[:8]}"
        self._waiting: dict[tuple[str, str], tuple[list[tuple[Any, ...]], trio.Event]] = {}
        self._lookups = trio.CapacityLimiter(max(1, options.concurrency))
        self.started = 0.0
        self.done = 0
        self.moved = 0

    # ----------------------------------------------------------------- workers

    async def _read(self, rank: _Rank) -> None:
        """Dispatch one worker's replies to the requests waiting for them, until cancelled."""
        while True:
            try:
                reply = await trio.to_thread.run_sync(
                    rank.conn.recv, limiter=rank.recv_limiter, abandon_on_cancel=True
                )
            except (EOFError, OSError):
                raise BenchError(f"worker {rank.rank} exited unexpectedly") from None
            if reply[0] == "error":
                raise BenchError(f"worker {reply[1]} failed: {reply[2]}")
            waiting = self._waiting.get((reply[0], reply[1]))
            if waiting is None:  # its request gave up waiting (the run is failing anyway)
                continue
            replies, event = waiting
            replies.append(reply)
            if len(replies) == len(self.ranks):
                event.set()

    async def _all(self, kind: str, rid: str, command: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Send ``command`` to every worker and wait for all their ``kind`` replies."""
        key = (kind, rid)
        replies: list[tuple[Any, ...]] = []
        event = trio.Event()
        self._waiting[key] = (replies, event)
        try:
            for rank in self.ranks:
                await rank.send(command)
            with trio.move_on_after(self.options.timeout):
                await event.wait()
            if not event.is_set():
                raise BenchError(f"the workers did not finish a {kind[:-1]} in time")
            return replies
        finally:
            del self._waiting[key]

    # ----------------------------------------------------------------- one request

    async def _lookup(self, rid: str, prompt: dict[str, Any]) -> int | None:
        scheduler = self.scheduler
        started = time.perf_counter()
        scheduler.maybe_submit_lookup_request(rid, **prompt)

        def wait() -> tuple[int | None, float]:
            hit = scheduler.check_lookup_result(rid, wait=self.options.timeout)
            return hit, time.perf_counter()

        hit, ended = await trio.to_thread.run_sync(wait, limiter=self._lookups)
        self.result.lookup_seconds.append(ended - started)
        return hit

    async def request(self, request: BenchRequest) -> None:
        """LOOKUP, RETRIEVE of the hits, STORE of the misses, END_SESSION."""
        chunk, size = self.chunk, self.options.block_size
        result = self.result
        rid = f"{self.prefix}-{request.index}"
        chunks = request.tokens // chunk
        usable = min(chunks * chunk // size, self.pool.total)
        cacheable = usable * size // chunk * chunk  # whole chunks of the blocks we can hold
        if cacheable < chunks * chunk:
            result.truncated += 1
        blocks = await self.pool.take(cacheable // size)
        try:
            hit = await self._lookup(rid, self.workload.prompt(request.index))
            if hit is None:
                result.lookup_failures += 1
                hit = 0
            hit = min(hit, cacheable)
            kept = hit
            if hit:
                first_failed = hit
                retrieve = ("retrieve", rid, request.index, hit, blocks)
                for reply in await self._all("retrieved", rid, retrieve):
                    _, _, seconds, loaded, failed, bad, moved, first = reply
                    result.retrieve_seconds.append(seconds)
                    result.retrieved_blocks += loaded
                    result.failed_blocks += failed
                    result.checksum_failures += bad
                    result.bytes_retrieved += moved
                    self.moved += moved
                    if first >= 0:
                        first_failed = min(first_failed, first * size // chunk * chunk)
                kept = first_failed  # the engine recomputes from the first failed chunk on
            if kept < cacheable:
                store = ("store", rid, request.index, kept, cacheable, blocks)
                for reply in await self._all("stored", rid, store):
                    _, _, seconds, moved = reply
                    result.store_seconds.append(seconds)
                    result.bytes_stored += moved
                    self.moved += moved
            self.scheduler.end_session(rid)
        finally:
            self.pool.give(blocks)
        result.requests.append(
            RequestRecord(
                request.index,
                time.perf_counter() - self.started,
                request.tokens,
                chunks,
                hit,
                hit // chunk,
            )
        )
        self.done += 1

    # ----------------------------------------------------------------- the workload

    async def run(self, on_progress: Callable[[Driver], None] | None = None) -> None:
        """Run every request of the workload; ``on_progress`` is called a few times a second.
        Cancelled, the requests in flight are cancelled with it (each waits for its thread)."""
        self.started = time.perf_counter()
        try:
            async with trio.open_nursery() as nursery:
                for rank in self.ranks:
                    nursery.start_soon(self._read, rank)
                if on_progress is not None:
                    nursery.start_soon(self._tick, on_progress)
                async with trio.open_nursery() as requests:
                    if self.workload.mode == "chat":
                        await self._chat(requests)
                    else:
                        await self._trace(requests)
                nursery.cancel_scope.cancel()
        finally:  # cancelled too: the partial table's rates are per the time it ran
            self.result.wall_seconds = time.perf_counter() - self.started

    async def _tick(self, on_progress: Callable[[Driver], None]) -> None:
        while True:
            on_progress(self)
            await trio.sleep(0.2)

    async def _chat(self, nursery: trio.Nursery) -> None:
        """Conversations start in order (at their arrival times, when a slot is free); each runs
        its turns one after the other."""
        slots = trio.Semaphore(self.options.concurrency)
        conversations: dict[int, list[BenchRequest]] = {}
        for request in self.workload.requests:
            conversations.setdefault(request.conversation, []).append(request)
        start = trio.current_time()

        async def converse(turns: list[BenchRequest]) -> None:
            try:
                for turn in turns:
                    await self.request(turn)
            finally:
                slots.release()

        for turns in conversations.values():
            await trio.sleep_until(start + turns[0].arrival)
            await slots.acquire()
            nursery.start_soon(converse, turns)

    async def _trace(self, nursery: trio.Nursery) -> None:
        """Requests start in trace order, at their (sped-up) timestamps if ``--speed``, at most
        ``concurrency`` at once."""
        slots = trio.Semaphore(self.options.concurrency)
        start = trio.current_time()

        async def one(request: BenchRequest) -> None:
            try:
                await self.request(request)
            finally:
                slots.release()

        for request in self.workload.requests:
            await trio.sleep_until(start + request.arrival)
            await slots.acquire()
            nursery.start_soon(one, request)


def engine_blocks(options: BenchOptions, workload: Workload, chunk: int, block_bytes: int) -> int:
    """Blocks per rank: ``--blocks``, or enough for ``concurrency`` of the largest requests
    (bounded by 2 GiB of KV per rank)."""
    if options.blocks:
        return options.blocks
    largest = max(r.tokens // chunk * chunk for r in workload.requests) // options.block_size
    wanted = max(64, largest * min(options.concurrency, len(workload.requests)))
    return max(1, min(wanted, (2 << 30) // max(1, block_bytes)))
