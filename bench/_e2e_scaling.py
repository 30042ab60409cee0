"""``bench/e2e.py --scaling``: stores and retrieves of 1 to 64 chunks next to a memcpy of the
same bytes, from L1 and from a disk L2.

A 4-layer flash_attn cache (4 MiB chunks of 256 tokens), one worker, one scheduler, medians of
``rounds`` per chunk count. *L1*: store, then retrieve into other blocks (the chunks are in
L1). *L2*: every sequence is stored into a server with a disk L2 (in a temporary directory),
the write-behind drained, the server restarted (its L1 is empty, the disk keeps the objects);
then per sequence a lookup (which finds the chunks on disk and starts loading them into L1)
and a retrieve (which waits for those loads). The disk L2 runs twice: as it is (loads from
the page cache: CPU work, competing with the copies for this machine's two cores), and
behind the ``fault`` backend adding a fixed latency to every call (as a remote L2 would: the
loads wait rather than work, 4 at a time). Copies are the worker's gather/scatter time;
*outside* is an operation's time minus its copies. A multi-chunk operation that overlaps its
copies with the protocol and the server's work keeps ``/copies`` near 1 as the chunk count
grows; one that waits for every chunk before the first copy pays the loads and the copies
one after the other.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np
from _kvbench import BLOCK, CHUNK, DIM, HEADS, CopyClock, Server, make_cache, poll, timed_copies

from kvtrio.client import LoadStoreOp, SchedulerAdapter, WorkerAdapter

LAYERS, COUNTS = 4, (1, 2, 4, 8, 16, 32, 64)
PER_CHUNK = CHUNK // BLOCK


def nbytes(chunks: int) -> int:
    return LAYERS * 2 * chunks * CHUNK * HEADS * DIM * 2


class Bench:
    """One worker and scheduler on ``server``, a clock of the worker's copies."""

    def __init__(self, server: Server, kind: str, rng: np.random.Generator) -> None:
        self.server = server
        self.rng = rng
        blocks = 2 * max(COUNTS) * PER_CHUNK  # a sequence's source and target blocks
        self.cache, _ = make_cache(kind, rng, LAYERS, blocks)
        self.blocks = blocks
        model = f"scale-{kind}"
        self.worker = WorkerAdapter(server.endpoint, model, 1, 0, BLOCK, timeout=60.0)
        self.scheduler = SchedulerAdapter(server.endpoint, model, 1, 0, BLOCK, timeout=60.0)
        self.clock = CopyClock()
        self.worker.register_kv_caches(self.cache, layout="flash_attn")
        poll(lambda: self.worker.registered, timeout=300.0)

    def connected(self, instance: str) -> bool:
        """The scheduler has met server ``instance`` (after a restart)."""
        info = self.scheduler.client.server_info
        return self.scheduler.client.connected and info is not None and info.instance_id == instance

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.close()

    def sequence(self, chunks: int) -> tuple[list[int], list[int], list[int]]:
        """Tokens, source blocks and target blocks of a new sequence."""
        n = chunks * PER_CHUNK
        source, target = np.split(self.rng.permutation(self.blocks)[: 2 * n], 2)
        tokens = self.rng.integers(0, 50_000, chunks * CHUNK).tolist()
        return tokens, source.tolist(), target.tolist()

    def store(self, rid: str, tokens: list[int], blocks: list[int]) -> tuple[float, float]:
        """Seconds until the worker reports the store finished, and in its copies."""
        self.clock.take()
        t0 = time.perf_counter()
        self.worker.submit_store_request(rid, LoadStoreOp(blocks, tokens, end=len(tokens)))
        poll(lambda: rid in self.worker.get_finished([rid])[0], timeout=120.0)
        return time.perf_counter() - t0, self.clock.take()

    def hits(self, rid: str, tokens: list[int]) -> bool:
        """Look ``tokens`` up; whether every chunk hit (the request is ended either way)."""
        self.scheduler.maybe_submit_lookup_request(rid, token_ids=tokens)
        poll(lambda: self.scheduler.check_lookup_result(rid) is not None, timeout=120.0)
        hit = self.scheduler.check_lookup_result(rid)
        self.end(rid)
        return hit == len(tokens)

    def lookup(self, rid: str, tokens: list[int]) -> float:
        t0 = time.perf_counter()
        self.scheduler.maybe_submit_lookup_request(rid, token_ids=tokens)
        poll(lambda: self.scheduler.check_lookup_result(rid) is not None, timeout=120.0)
        elapsed = time.perf_counter() - t0
        hit = self.scheduler.check_lookup_result(rid)
        assert hit == len(tokens), f"the lookup found {hit} of {len(tokens)} tokens"
        return elapsed

    def retrieve(self, rid: str, tokens: list[int], blocks: list[int]) -> tuple[float, float]:
        self.clock.take()
        t0 = time.perf_counter()
        self.worker.submit_retrieve_request(rid, LoadStoreOp(blocks, tokens, end=len(tokens)))
        poll(lambda: rid in self.worker.get_finished([])[1], timeout=120.0)
        elapsed = time.perf_counter() - t0
        assert not self.worker.get_block_ids_with_load_errors(), f"{rid}: a chunk failed"
        return elapsed, self.clock.take()

    def end(self, rid: str) -> None:
        self.scheduler.end_session(rid)
        self.scheduler.cleanup_lookup_result(rid)


def memcpy(chunks: int, buffers: dict[int, tuple[np.ndarray, np.ndarray]]) -> float:  # type: ignore[type-arg]
    if chunks not in buffers:
        buffers.clear()
        buffers[chunks] = (np.ones(nbytes(chunks), np.uint8), np.ones(nbytes(chunks), np.uint8))
    a, b = buffers[chunks]
    t0 = time.perf_counter()
    np.copyto(b, a)
    return time.perf_counter() - t0


def from_l1(kind: str, rng: np.random.Generator, rounds: int) -> dict[int, dict[str, float]]:
    """Per chunk count, medians: store, retrieve, their copies, memcpy."""
    out: dict[int, dict[str, float]] = {}
    buffers: dict[int, Any] = {}
    with Server("--l1-size", "2GiB", "--l2", "none") as server:
        bench = Bench(server, kind, rng)
        try:
            with timed_copies(bench.clock):
                bench.store("warm-up", *bench.sequence(4)[:2])
                for chunks in COUNTS:
                    samples: dict[str, list[float]] = {}
                    for r in range(rounds):
                        tokens, source, target = bench.sequence(chunks)
                        rid = f"{chunks}-{r}"
                        store, store_copy = bench.store(f"s{rid}", tokens, source)
                        retrieve, retrieve_copy = bench.retrieve(f"r{rid}", tokens, target)
                        for key, value in (
                            ("store", store),
                            ("store/copy", store_copy),
                            ("store/outside", store - store_copy),
                            ("retrieve", retrieve),
                            ("retrieve/copy", retrieve_copy),
                            ("retrieve/outside", retrieve - retrieve_copy),
                            ("memcpy", memcpy(chunks, buffers)),
                        ):
                            samples.setdefault(key, []).append(value)
                    out[chunks] = {k: statistics.median(v) for k, v in samples.items()}
        finally:
            bench.close()
    return out


def from_l2(
    kind: str, rng: np.random.Generator, rounds: int, latency: float = 0.0
) -> dict[int, dict[str, float]]:
    """Per chunk count, medians: lookup, retrieve (waiting for the loads), its copies, the
    whole hit cycle, memcpy. The chunks come from a disk L2 after a server restart; with
    ``latency``, every call to it takes that many seconds more."""
    out: dict[int, dict[str, float]] = {}
    buffers: dict[int, Any] = {}
    directory = tempfile.mkdtemp(prefix="kvb-l2-", dir="/tmp")
    # (fault's inner disk takes its default path, under the server's HOME)
    l2 = f"fault:inner=disk,latency={latency}" if latency else f"disk:path={directory}"
    options = ("--l1-size", "2GiB", "--l2", l2, "--retrieve-timeout", "60", "--l2-admission", "all")
    sequences: dict[tuple[int, int], tuple[list[int], list[int], list[int]]] = {}
    try:
        with Server(*options, home=directory) as server:
            bench = Bench(server, kind, rng)
            try:
                warm_up = bench.sequence(1)
                bench.store("warm-up", *warm_up[:2])
                for chunks in COUNTS:
                    for r in range(rounds):
                        sequences[chunks, r] = bench.sequence(chunks)
                        bench.store(f"s{chunks}-{r}", *sequences[chunks, r][:2])
                        poll(lambda: _written(server), timeout=300.0)
                assert _skipped(server) == 0, "the write-behind skipped chunks"
                server.restart()  # L1 is empty now; the disk keeps the objects
                instance = server.stats().instance_id
                poll(lambda: bench.worker.registered, timeout=300.0)
                poll(lambda: bench.connected(instance), timeout=300.0)
                # The first lookup scans the disk; it may take longer than a lookup may.
                poll(lambda: bench.hits("warm-up", warm_up[0]), timeout=300.0)
                with timed_copies(bench.clock):
                    for chunks in COUNTS:
                        samples: dict[str, list[float]] = {}
                        for r in range(rounds):
                            tokens, _, target = sequences[chunks, r]
                            rid = f"r{chunks}-{r}"
                            lookup = bench.lookup(rid, tokens)
                            retrieve, copies = bench.retrieve(rid, tokens, target)
                            bench.end(rid)
                            for key, value in (
                                ("lookup", lookup),
                                ("retrieve", retrieve),
                                ("retrieve/copy", copies),
                                ("retrieve/outside", retrieve - copies),
                                ("cycle", lookup + retrieve),
                                ("memcpy", memcpy(chunks, buffers)),
                            ):
                                samples.setdefault(key, []).append(value)
                        out[chunks] = {k: statistics.median(v) for k, v in samples.items()}
            finally:
                bench.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return out


def _written(server: Server) -> bool:
    """The write-behind is done: nothing queued, nothing pinned (it pins what it writes)."""
    cache = server.stats().cache
    assert cache is not None
    return cache.write_behind_queued == 0 and cache.l1_pinned_entries == 0


def _skipped(server: Server) -> int:
    cache = server.stats().cache
    return cache.write_behind_skipped if cache is not None else 0


def report(
    kind: str, rounds: int, l1: dict[int, dict[str, float]], l2: dict[str, dict[int, Any]]
) -> None:
    head = f"{LAYERS} layers, {CHUNK}-token chunks ({nbytes(1) >> 20} MiB), medians of {rounds}"
    if l1:
        report_l1(f"L1, {kind} KV cache: {head}", l1)
    for name, rows in l2.items():
        report_l2(f"{name} (after a server restart), {kind} KV cache: {head}", rows)


def report_l1(title: str, l1: dict[int, dict[str, float]]) -> None:
    print(f"\nscaling from {title}\n")
    print(
        f"{'chunks':>6}{'MiB':>6}{'store':>9}{'copies':>8}{'outside':>9}{'retrieve':>10}"
        f"{'copies':>8}{'outside':>9}{'memcpy':>8}{'store/':>9}{'retrieve/':>11}"
        f"{'retrieve/':>11}"
    )
    print(
        f"{'':6}{'':6}{'ms':>9}{'ms':>8}{'ms':>9}{'ms':>10}{'ms':>8}{'ms':>9}{'ms':>8}"
        f"{'copies':>9}{'copies':>11}{'memcpy':>11}"
    )
    for chunks, m in l1.items():
        print(
            f"{chunks:>6}{nbytes(chunks) >> 20:>6}{m['store'] * 1e3:>9.2f}"
            f"{m['store/copy'] * 1e3:>8.2f}{m['store/outside'] * 1e3:>9.2f}"
            f"{m['retrieve'] * 1e3:>10.2f}{m['retrieve/copy'] * 1e3:>8.2f}"
            f"{m['retrieve/outside'] * 1e3:>9.2f}{m['memcpy'] * 1e3:>8.2f}"
            f"{m['store'] / m['store/copy']:>9.2f}{m['retrieve'] / m['retrieve/copy']:>11.2f}"
            f"{m['retrieve'] / m['memcpy']:>11.2f}"
        )


def report_l2(title: str, rows: dict[int, dict[str, float]]) -> None:
    print(f"\nscaling from {title}\n")
    print(
        f"{'chunks':>6}{'MiB':>6}{'lookup':>9}{'retrieve':>10}{'copies':>8}{'outside':>9}"
        f"{'cycle':>9}{'memcpy':>8}{'retrieve/':>11}{'retrieve/':>11}"
    )
    print(
        f"{'':6}{'':6}{'ms':>9}{'ms':>10}{'ms':>8}{'ms':>9}{'ms':>9}{'ms':>8}"
        f"{'copies':>11}{'memcpy':>11}"
    )
    for chunks, m in rows.items():
        print(
            f"{chunks:>6}{nbytes(chunks) >> 20:>6}{m['lookup'] * 1e3:>9.2f}"
            f"{m['retrieve'] * 1e3:>10.2f}{m['retrieve/copy'] * 1e3:>8.2f}"
            f"{m['retrieve/outside'] * 1e3:>9.2f}{m['cycle'] * 1e3:>9.2f}"
            f"{m['memcpy'] * 1e3:>8.2f}{m['retrieve'] / m['retrieve/copy']:>11.2f}"
            f"{m['retrieve'] / m['memcpy']:>11.2f}"
        )
