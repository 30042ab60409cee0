"""Store, lookup, retrieve of whole sequences through a real server: the `lmcache bench server`
workload.

    python bench/e2e.py [--sequences 24] [--l1-size 2GiB]

A ``kvtrio serve`` process and, in this process, an engine made of a SchedulerAdapter and a
WorkerAdapter whose KV cache is 32 layers × 1024 blocks of 16 tokens × 8 heads × 128, fp16
(flash_attn layout, 2 GiB of ordinary memory). Every sequence is 2 chunks of 256 tokens
(64 MiB of KV). Per sequence, timed through the adapters' public API (submit, then poll
``get_finished`` / ``check_lookup_result``): the store, the lookup, the retrieve into other
blocks, and the full hit cycle (lookup + retrieve). Next to it, in the same run, a plain memcpy
of one sequence's bytes. Every retrieve is checked byte for byte.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from kvtrio.client import Client, LoadStoreOp, SchedulerAdapter, WorkerAdapter
from kvtrio.protocol import Ping

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 32, 1024, 16, 8, 128
CHUNK, CHUNKS = 256, 2
TOKENS = CHUNK * CHUNKS
SEQ_BLOCKS = TOKENS // BLOCK


def poll(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the operation did not finish")
        time.sleep(0.0002)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=24)
    parser.add_argument("--l1-size", default="2GiB")
    args = parser.parse_args()

    endpoint = f"ipc://{tempfile.mkdtemp(prefix='kvb-', dir='/tmp')}/kvtrio.sock"
    env = {**os.environ, "KVTRIO_LOG_LEVEL": "warning"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtrio",
            "serve",
            "--endpoint",
            endpoint,
            "--l1-size",
            args.l1_size,
        ],
        env=env,
    )
    rng = np.random.default_rng(0)
    print("allocating and filling a 2 GiB KV cache …", file=sys.stderr)
    layers = [
        rng.integers(0, 2**16, (2, BLOCKS, BLOCK, HEADS, DIM), dtype=np.uint16).view(np.float16)
        for _ in range(LAYERS)
    ]
    try:
        with Client(endpoint) as probe:
            poll(lambda: probe.server_info is not None)
            probe.request(Ping())
        worker = WorkerAdapter(endpoint, "bench-model", 1, 0, BLOCK, timeout=30.0)
        scheduler = SchedulerAdapter(endpoint, "bench-model", 1, 0, BLOCK, timeout=30.0)
        worker.register_kv_caches(
            {f"layer.{i}": a for i, a in enumerate(layers)}, layout="flash_attn"
        )
        poll(lambda: worker.registered)
        results = run(worker, scheduler, layers, rng, args.sequences)
        worker.shutdown()
        scheduler.close()
    finally:
        server.terminate()
        server.wait()
    report(results, args.sequences)


def run(
    worker: WorkerAdapter,
    scheduler: SchedulerAdapter,
    layers: list[np.ndarray],  # type: ignore[type-arg]
    rng: np.random.Generator,
    sequences: int,
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {
        k: [] for k in ("store", "lookup", "retrieve", "cycle", "memcpy")
    }
    nbytes = LAYERS * 2 * TOKENS * HEADS * DIM * 2
    a, b = np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    a[:] = 1
    for seq in range(sequences):
        tokens = rng.integers(0, 50_000, TOKENS).tolist()
        source, target = np.split(rng.permutation(BLOCKS)[: 2 * SEQ_BLOCKS], 2)
        expected = [layer[:, source].copy() for layer in layers]

        t0 = time.perf_counter()
        worker.submit_store_request(
            f"s{seq}", LoadStoreOp(source.tolist(), token_ids=tokens, end=TOKENS)
        )
        poll(lambda seq=seq: f"s{seq}" in worker.get_finished([f"s{seq}"])[0])
        times["store"].append(time.perf_counter() - t0)

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
        times["lookup"].append(t1 - t0)
        times["retrieve"].append(t2 - t1)
        times["cycle"].append(t2 - t0)
        assert not worker.get_block_ids_with_load_errors()
        for layer, before in zip(layers, expected, strict=True):
            assert np.array_equal(layer[:, target].view(np.uint16), before.view(np.uint16)), (
                "bytes differ"
            )
        scheduler.end_session(f"r{seq}")
        scheduler.cleanup_lookup_result(f"r{seq}")

        t0 = time.perf_counter()
        np.copyto(b, a)
        times["memcpy"].append(time.perf_counter() - t0)
    return times


def report(times: dict[str, list[float]], sequences: int) -> None:
    nbytes = LAYERS * 2 * TOKENS * HEADS * DIM * 2
    memcpy = statistics.median(times["memcpy"])
    print(
        f"\ne2e bench: {sequences} sequences of {CHUNKS} chunks × {CHUNK} tokens "
        f"({nbytes / 2**20:.0f} MiB of KV each), {LAYERS} layers, {HEADS}×{DIM}, fp16, medians\n"
    )
    print(f"{'':26}{'p50 ms':>10}{'p90 ms':>10}{'GB/s':>8}{'× memcpy time':>15}")
    for name, label in [
        ("store", "store (copy + commit)"),
        ("lookup", "lookup"),
        ("retrieve", "retrieve (copy + release)"),
        ("cycle", "full hit cycle"),
        ("memcpy", "memcpy of the same bytes"),
    ]:
        values = sorted(times[name])
        p50, p90 = statistics.median(values), values[int(len(values) * 0.9)]
        rate = (
            f"{nbytes / p50 / 1e9:>8.2f}" if name in ("store", "retrieve", "memcpy") else f"{'':>8}"
        )
        print(f"{label:26}{p50 * 1e3:>10.2f}{p90 * 1e3:>10.2f}{rate}{p50 / memcpy:>15.2f}")


if __name__ == "__main__":
    main()
