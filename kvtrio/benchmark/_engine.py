"""A simulated engine worker (one process per rank): its KV cache, its WorkerAdapter, its checks.

The driver sends commands over a pipe; the worker answers each once, from a reporter thread:

* ``("retrieve", rid, index, hit_tokens, blocks)``: poison the blocks, retrieve the hit chunks
  into them through the adapter, then check every loaded block byte for byte;
  answers ``("retrieved", rid, seconds, loaded, failed, bad, bytes, first_failed)`` (block
  counts; the position of the first failed block, or -1);
* ``("store", rid, index, start, end, blocks)``: write the KV of tokens ``[start, end)`` (the
  "prefill"), store them through the adapter; answers ``("stored", rid, seconds, bytes)``;
* ``("stop",)``: shut the adapter down and exit.

The worker rebuilds the workload from the options, so commands carry request numbers only.
Timings are the adapter's: from submitting to the future being done (copies, the server's
replies, and queueing behind this rank's other transfers).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import attrs
import numpy as np

from ..client import LoadStoreOp, WorkerAdapter
from ..protocol import HASH_SCHEME_TOKENS, block_hash_scheme
from ..transfer import KVLayout
from ._content import BlockContent, numpy_dtype
from ._options import BenchOptions
from ._workload import load_workload

__all__ = ["ENGINE_HASH", "model_name", "worker_main"]

ENGINE_HASH = "kvtrio-bench-trace"
"""The hash-mode scheme name of the bench's engine block hashes."""


def model_name(options: BenchOptions) -> str:
    """The model the bench registers: the shape is in the name, so that runs with other shapes
    against one server do not collide with the profile of an earlier run."""
    o = options
    return (
        f"kvtrio-bench/{o.mode}/{o.layers}x{o.heads}x{o.head_dim}/{o.dtype}/tp{o.world_size}"
        f"/b{o.block_size}"
    )


def worker_main(
    conn: Connection, options: BenchOptions, rank: int, endpoint: str, blocks: int, tenant: str
) -> None:
    """Entry point of a worker process (spawned by the driver)."""
    logging.basicConfig(level=logging.WARNING)
    try:
        _Worker(conn, options, rank, endpoint, blocks, tenant).run()
    except Exception as exc:  # report, do not hang the driver
        conn.send(("error", rank, f"{type(exc).__name__}: {exc}"))


class _Worker:
    def __init__(
        self,
        conn: Connection,
        options: BenchOptions,
        rank: int,
        endpoint: str,
        blocks: int,
        tenant: str,
    ) -> None:
        self.conn = conn
        self.options = options
        self.rank = rank
        self.workload = load_workload(options)
        o = options
        self.layout = KVLayout(
            o.layout,
            o.layers,
            blocks,
            o.block_size,
            1 if o.layout == "mla" else o.heads_per_rank,
            o.head_dim,
            o.dtype,
        )
        dtype = numpy_dtype(o.dtype)
        self.arrays = [np.zeros(self.layout.layer_shape, dtype) for _ in range(o.layers)]
        self.content = BlockContent(self.layout, self.arrays, rank)
        scheme = block_hash_scheme(ENGINE_HASH) if self.workload.hash_mode else HASH_SCHEME_TOKENS
        self.adapter = WorkerAdapter(
            endpoint,
            model_name(o),
            o.world_size,
            rank,
            o.block_size,
            tenant=tenant,
            hash_scheme=scheme,
            timeout=o.timeout,
        )
        self.reports: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self.load_errors: set[int] = set()

    def run(self) -> None:
        self.adapter.register_kv_caches(
            {f"layer.{i}": a for i, a in enumerate(self.arrays)}, layout=self.options.layout
        )
        deadline = time.monotonic() + self.options.timeout
        while not self.adapter.registered:
            if time.monotonic() > deadline:
                raise RuntimeError("the worker could not register with the server")
            time.sleep(0.01)
        reporter = threading.Thread(target=self._report, name="kvtrio-bench-reporter")
        reporter.start()
        self.conn.send(("ready", self.rank, self.adapter.chunk_size))
        try:
            while True:
                command = self.conn.recv()
                if command[0] == "retrieve":
                    self._retrieve(*command[1:])
                elif command[0] == "store":
                    self._store(*command[1:])
                else:
                    break
        finally:
            self.adapter.shutdown()
            self.reports.put(None)
            reporter.join()

    def _op(self, index: int, blocks: np.ndarray[Any, Any], start: int, end: int) -> LoadStoreOp:
        return LoadStoreOp(
            block_ids=blocks.tolist(), start=start, end=end, **self.workload.prompt(index)
        )

    def _retrieve(self, rid: str, index: int, hit: int, blocks: np.ndarray[Any, Any]) -> None:
        used = blocks[: hit // self.options.block_size]
        self.content.poison(used)
        started = time.perf_counter()
        future = self.adapter.submit_retrieve_request(rid, self._op(index, used, 0, hit))
        future.add_done_callback(
            lambda f: self.reports.put(("retrieved", rid, index, used, started, _ended(f)))
        )

    def _store(
        self, rid: str, index: int, start: int, end: int, blocks: np.ndarray[Any, Any]
    ) -> None:
        size = self.options.block_size
        used = blocks[: end // size]
        identities = self.workload.identities(index)
        self.content.fill(used[start // size :], identities[start // size : end // size])
        started = time.perf_counter()
        # Stores carry the blocks' names as an engine's KV events give them (64-bit ints).
        op = attrs.evolve(
            self._op(index, used, start, end),
            event_hashes=identities[start // size : end // size].tolist(),
        )
        future = self.adapter.submit_store_request(rid, op)
        future.add_done_callback(
            lambda f: self.reports.put(
                ("stored", rid, index, (end - start) // size, started, _ended(f))
            )
        )

    def _report(self) -> None:
        """Check retrieves and answer the driver, in order of completion (own thread)."""
        while (item := self.reports.get()) is not None:
            if item[0] == "retrieved":
                _, rid, index, blocks, started, ended = item
                self.load_errors |= self.adapter.get_block_ids_with_load_errors()
                failed = [b for b in blocks.tolist() if b in self.load_errors]
                self.load_errors.difference_update(failed)
                ok = ~np.isin(blocks, failed)
                first = int(np.argmin(ok)) if failed else -1
                identities = self.workload.identities(index)[: len(blocks)]
                bad = self.content.mismatches(blocks[ok], identities[ok])
                loaded = int(ok.sum())
                moved = loaded * self.content.block_bytes
                self.conn.send(
                    ("retrieved", rid, ended - started, loaded, len(failed), bad, moved, first)
                )
            else:
                _, rid, index, count, started, ended = item
                self.adapter.get_finished([rid])  # the engine is done with it: forget it
                self.conn.send(("stored", rid, ended - started, count * self.content.block_bytes))


def _ended(_future: Future[None]) -> float:
    return time.perf_counter()
