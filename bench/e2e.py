"""Store, lookup, retrieve of whole sequences through a real server: the `lmcache bench server`
workload, with numpy and with torch KV caches.

    python bench/e2e.py [--sequences 24] [--l1-size 2GiB] [--kv numpy torch] [--scaling]

A ``kvtrio serve`` process and, in this process, an engine made of a SchedulerAdapter and a
WorkerAdapter whose KV cache is 32 layers × 1024 blocks of 16 tokens × 8 heads × 128, fp16
(flash_attn layout, 2 GiB of ordinary memory), allocated by numpy (``np.empty``: 16 bytes past a
page, as numpy aligns) and then by torch (64-byte aligned, as an engine's cache is). Every
sequence is 2 chunks of 256 tokens (64 MiB of KV). Per sequence, timed as an engine sees it
through the adapters' public API (submit, then poll ``get_finished`` / ``check_lookup_result``):
the store, the lookup, the retrieve into other blocks, the full hit cycle (lookup + retrieve),
and a ``ping`` round trip. Next to it, in the same run, a plain memcpy of one sequence's bytes.
Every retrieve is checked byte for byte.

The worker's copies (``gather`` / ``scatter`` in its transfer thread) are timed by wrapping
them, so each operation's time splits into *copies* and *outside* (protocol, server, waiting,
polling): a regression shows where it comes from. The checks at the end are issue 17's targets:
retrieve ≤ 1.3× memcpy and ≤ 1.2× store, lookup ≤ 2× ping.

``--scaling`` then stores and retrieves sequences of 1 to 64 chunks (a 4-layer cache of the same
shape, 4 MiB chunks, the last KV kind) next to a memcpy of the same bytes: per-chunk costs
outside the copies show as a ratio that grows with the chunk count.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

import kvtrio.client._worker as worker_module
from kvtrio.client import Client, LoadStoreOp, SchedulerAdapter, WorkerAdapter
from kvtrio.protocol import Ping
from kvtrio.transfer._cpu_native import cpu_helper

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 32, 1024, 16, 8, 128
CHUNK, CHUNKS = 256, 2
TOKENS = CHUNK * CHUNKS
SEQ_BLOCKS = TOKENS // BLOCK
NBYTES = LAYERS * 2 * TOKENS * HEADS * DIM * 2
OPS = ("store", "lookup", "retrieve", "cycle", "ping", "memcpy")


class CopyClock:
    """Seconds the worker spent in gather/scatter since the last :meth:`take`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spent = 0.0

    def wrap(self, fn: Callable[..., None]) -> Callable[..., None]:
        def timed(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            try:
                fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._spent += time.perf_counter() - start

        return timed

    def take(self) -> float:
        with self._lock:
            spent, self._spent = self._spent, 0.0
        return spent


@contextmanager
def timed_copies(clock: CopyClock) -> Iterator[None]:
    """Wrap the worker's gather and scatter (the worker module's names) while inside."""
    gather, scatter = worker_module.gather, worker_module.scatter
    worker_module.gather, worker_module.scatter = clock.wrap(gather), clock.wrap(scatter)  # type: ignore[assignment]
    try:
        yield
    finally:
        worker_module.gather, worker_module.scatter = gather, scatter  # type: ignore[assignment]


def poll(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the operation did not finish")
        time.sleep(0.0002)


def make_cache(
    kind: str, rng: np.random.Generator, layers: int = LAYERS
) -> tuple[dict[str, Any], list[np.ndarray]]:  # type: ignore[type-arg]
    """The engine's KV tensors and numpy views of them (to check bytes)."""
    shape = (2, BLOCKS, BLOCK, HEADS, DIM)
    if kind == "numpy":
        arrays = []
        for _ in range(layers):
            array = np.empty(shape, np.float16)
            array.view(np.uint16)[...] = rng.integers(0, 2**16, shape, dtype=np.uint16)
            arrays.append(array)
        return {f"layer.{i}": a for i, a in enumerate(arrays)}, arrays
    import torch

    tensors = []
    for _ in range(layers):
        tensor = torch.empty(shape, dtype=torch.float16)
        tensor.view(torch.int16).numpy()[...] = rng.integers(-(2**15), 2**15, shape, np.int16)
        tensors.append(tensor)
    views = [t.view(torch.int16).numpy() for t in tensors]
    return {f"layer.{i}": t for i, t in enumerate(tensors)}, views


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=24)
    parser.add_argument("--l1-size", default="2GiB")
    parser.add_argument("--kv", nargs="+", choices=("numpy", "torch"), default=None)
    parser.add_argument("--scaling", action="store_true", help="also 1…64 chunks per sequence")
    args = parser.parse_args()
    kinds = args.kv
    if kinds is None:
        try:
            import torch  # noqa: F401
        except ImportError:
            kinds = ["numpy"]
            print("torch is not installed: numpy KV caches only", file=sys.stderr)
        else:
            kinds = ["numpy", "torch"]

    endpoint = f"ipc://{tempfile.mkdtemp(prefix='kvb-', dir='/tmp')}/kvtrio.sock"
    env = {**os.environ, "KVTRIO_LOG_LEVEL": "warning"}
    command = [sys.executable, "-m", "kvtrio", "serve", "--endpoint", endpoint]
    server = subprocess.Popen([*command, "--l1-size", args.l1_size], env=env)
    rng = np.random.default_rng(0)
    results: dict[str, dict[str, list[float]]] = {}
    try:
        with Client(endpoint) as probe:
            poll(lambda: probe.server_info is not None)
            probe.request(Ping())
            for kind in kinds:
                print(f"{kind}: allocating and filling a 2 GiB KV cache …", file=sys.stderr)
                cache, views = make_cache(kind, rng)
                model = f"bench-{kind}"
                worker = WorkerAdapter(endpoint, model, 1, 0, BLOCK, timeout=30.0)
                scheduler = SchedulerAdapter(endpoint, model, 1, 0, BLOCK, timeout=30.0)
                try:
                    worker.register_kv_caches(cache, layout="flash_attn")
                    poll(lambda worker=worker: worker.registered, timeout=300.0)
                    results[kind] = run(worker, scheduler, probe, views, rng, args.sequences)
                finally:
                    worker.shutdown()
                    scheduler.close()
                del cache, views
                gc.collect()
            if args.scaling:
                scaled = scaling(endpoint, kinds[-1], rng)
    finally:
        server.terminate()
        server.wait()
    for kind, times in results.items():
        report(kind, times, args.sequences)
    if args.scaling:
        report_scaling(kinds[-1], scaled)


SCALE_LAYERS, SCALE_CHUNKS, SCALE_ROUNDS = 4, (1, 2, 4, 8, 16, 32, 64), 5


def scaling(endpoint: str, kind: str, rng: np.random.Generator) -> dict[int, dict[str, float]]:
    """Median store / retrieve / copies / memcpy seconds per chunk count."""
    cache, _ = make_cache(kind, rng, SCALE_LAYERS)
    blocks_per_chunk = CHUNK // BLOCK
    worker = WorkerAdapter(endpoint, f"scale-{kind}", 1, 0, BLOCK, timeout=30.0)
    clock = CopyClock()
    out: dict[int, dict[str, float]] = {}
    try:
        worker.register_kv_caches(cache, layout="flash_attn")
        poll(lambda: worker.registered, timeout=300.0)
        with timed_copies(clock):
            for chunks in SCALE_CHUNKS:
                nbytes = SCALE_LAYERS * 2 * chunks * CHUNK * HEADS * DIM * 2
                a, b = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)
                samples: dict[str, list[float]] = {
                    k: [] for k in ("store", "retrieve", "copy", "memcpy")
                }
                for r in range(SCALE_ROUNDS):
                    n = chunks * blocks_per_chunk
                    source, target = np.split(rng.permutation(BLOCKS)[: 2 * n], 2)
                    tokens = rng.integers(0, 50_000, chunks * CHUNK).tolist()
                    op = f"{chunks}-{r}"
                    clock.take()
                    t0 = time.perf_counter()
                    worker.submit_store_request(
                        f"s{op}", LoadStoreOp(source.tolist(), token_ids=tokens, end=len(tokens))
                    )
                    poll(lambda op=op: f"s{op}" in worker.get_finished([f"s{op}"])[0])
                    samples["store"].append(time.perf_counter() - t0)
                    clock.take()
                    t0 = time.perf_counter()
                    worker.submit_retrieve_request(
                        f"r{op}", LoadStoreOp(target.tolist(), token_ids=tokens, end=len(tokens))
                    )
                    poll(lambda op=op: f"r{op}" in worker.get_finished([f"r{op}"])[1])
                    samples["retrieve"].append(time.perf_counter() - t0)
                    samples["copy"].append(clock.take())
                    assert not worker.get_block_ids_with_load_errors(), "a chunk failed to load"
                    t0 = time.perf_counter()
                    np.copyto(b, a)
                    samples["memcpy"].append(time.perf_counter() - t0)
                out[chunks] = {k: statistics.median(v) for k, v in samples.items()}
                out[chunks]["nbytes"] = nbytes
    finally:
        worker.shutdown()
    return out


def report_scaling(kind: str, scaled: dict[int, dict[str, float]]) -> None:
    print(
        f"\nscaling, {kind} KV cache: {SCALE_LAYERS} layers, {CHUNK}-token chunks, medians of "
        f"{SCALE_ROUNDS}; retrieve copies = the worker's scatter time\n"
    )
    print(
        f"{'chunks':>6}{'MiB':>7}{'store ms':>10}{'retrieve ms':>13}{'copies ms':>11}"
        f"{'memcpy ms':>11}{'store/memcpy':>14}{'retrieve/memcpy':>17}{'outside ms':>12}"
    )
    for chunks, m in scaled.items():
        print(
            f"{chunks:>6}{m['nbytes'] / 2**20:>7.0f}{m['store'] * 1e3:>10.2f}"
            f"{m['retrieve'] * 1e3:>13.2f}{m['copy'] * 1e3:>11.2f}{m['memcpy'] * 1e3:>11.2f}"
            f"{m['store'] / m['memcpy']:>14.2f}{m['retrieve'] / m['memcpy']:>17.2f}"
            f"{(m['retrieve'] - m['copy']) * 1e3:>12.2f}"
        )


def run(
    worker: WorkerAdapter,
    scheduler: SchedulerAdapter,
    probe: Client,
    layers: list[np.ndarray],  # type: ignore[type-arg]
    rng: np.random.Generator,
    sequences: int,
) -> dict[str, list[float]]:
    """Per operation: total seconds (key), and seconds in the worker's copies (key + "/copy")."""
    times: dict[str, list[float]] = {k: [] for k in OPS}
    times.update({f"{k}/copy": [] for k in ("store", "retrieve", "cycle")})
    a, b = np.empty(NBYTES, np.uint8), np.empty(NBYTES, np.uint8)
    a[:] = 1
    b[:] = 1
    clock = CopyClock()
    with timed_copies(clock):
        for seq in range(sequences):
            tokens = rng.integers(0, 50_000, TOKENS).tolist()
            source, target = np.split(rng.permutation(BLOCKS)[: 2 * SEQ_BLOCKS], 2)
            expected = [layer[:, source].copy() for layer in layers]

            clock.take()
            t0 = time.perf_counter()
            worker.submit_store_request(
                f"s{seq}", LoadStoreOp(source.tolist(), token_ids=tokens, end=TOKENS)
            )
            poll(lambda seq=seq: f"s{seq}" in worker.get_finished([f"s{seq}"])[0])
            times["store"].append(time.perf_counter() - t0)
            times["store/copy"].append(clock.take())

            t0 = time.perf_counter()
            scheduler.maybe_submit_lookup_request(f"r{seq}", token_ids=tokens)
            poll(lambda seq=seq: scheduler.check_lookup_result(f"r{seq}") is not None)
            t1 = time.perf_counter()
            got = scheduler.check_lookup_result(f"r{seq}")
            assert got == TOKENS, f"the lookup of sequence {seq} found {got} tokens, not {TOKENS}"
            worker.submit_retrieve_request(
                f"r{seq}", LoadStoreOp(target.tolist(), token_ids=tokens, end=TOKENS)
            )
            poll(lambda seq=seq: f"r{seq}" in worker.get_finished([])[1])
            t2 = time.perf_counter()
            copies = clock.take()
            times["lookup"].append(t1 - t0)
            times["retrieve"].append(t2 - t1)
            times["retrieve/copy"].append(copies)
            times["cycle"].append(t2 - t0)
            times["cycle/copy"].append(copies)
            assert not worker.get_block_ids_with_load_errors()
            for layer, before in zip(layers, expected, strict=True):
                assert np.array_equal(layer[:, target].view(np.uint16), before.view(np.uint16)), (
                    "bytes differ"
                )
            scheduler.end_session(f"r{seq}")
            scheduler.cleanup_lookup_result(f"r{seq}")

            t0 = time.perf_counter()
            probe.request(Ping())
            times["ping"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            np.copyto(b, a)
            times["memcpy"].append(time.perf_counter() - t0)
    return times


def report(kind: str, times: dict[str, list[float]], sequences: int) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    memcpy = med["memcpy"]
    path = "C helper" if cpu_helper() is not None else "numpy"
    print(
        f"\ne2e bench, {kind} KV cache: {sequences} sequences of {CHUNKS} chunks × {CHUNK} tokens "
        f"({NBYTES / 2**20:.0f} MiB of KV each), {LAYERS} layers, {HEADS}×{DIM}, fp16; worker "
        f"copies by {path}; medians (p90)\n"
    )
    print(
        f"{'':26}{'p50 ms':>9}{'p90 ms':>9}{'GB/s':>7}{'× memcpy':>10}"
        f"{'copies ms':>11}{'GB/s':>7}{'outside ms':>12}"
    )
    for name, label in [
        ("store", "store (copy + commit)"),
        ("lookup", "lookup"),
        ("retrieve", "retrieve (copy + release)"),
        ("cycle", "full hit cycle"),
        ("ping", "ping"),
        ("memcpy", "memcpy of the same bytes"),
    ]:
        values = sorted(times[name])
        p50, p90 = med[name], values[int(len(values) * 0.9)]
        moves = name in ("store", "retrieve", "cycle", "memcpy")
        rate = f"{NBYTES / p50 / 1e9:>7.2f}" if moves else f"{'':>7}"
        line = f"{label:26}{p50 * 1e3:>9.2f}{p90 * 1e3:>9.2f}{rate}{p50 / memcpy:>10.2f}"
        if f"{name}/copy" in times:
            copies = times[f"{name}/copy"]
            outside = statistics.median(t - c for t, c in zip(times[name], copies, strict=True))
            copy = med[f"{name}/copy"]
            line += f"{copy * 1e3:>11.2f}{NBYTES / copy / 1e9:>7.2f}{outside * 1e3:>12.2f}"
        print(line)
    checks = [
        ("retrieve / memcpy", med["retrieve"] / memcpy, 1.3),
        ("retrieve / store", med["retrieve"] / med["store"], 1.2),
        ("lookup / ping", med["lookup"] / med["ping"], 2.0),
    ]
    print(
        "targets: "
        + "; ".join(
            f"{name} {value:.2f} (≤ {limit}: {'ok' if value <= limit else 'MISSED'})"
            for name, value, limit in checks
        )
    )


if __name__ == "__main__":
    main()
