"""L2 backend throughput next to the raw client or file I/O doing the same transfers.

    python bench/backends.py [--repeats 5] [--only disk,redis,s3]

For objects of 2 MiB and 32 MiB (a 72-byte frame header plus the chunk, handed over as
memoryviews like the server does), store and load throughput through the backend API, and the
same bytes moved by the raw client (file I/O for ``disk``; redis-py and obstore for the others,
see ``bench/backends_redis.py`` and ``bench/backends_s3.py``, which start their own Redis and
SeaweedFS on loopback). Same concurrency on both sides, interleaved over ``--repeats`` rounds,
medians. Target: backend ≥ 0.8 × raw.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).parent))

from kvtrio.l2 import HEADER_SIZE, header
from kvtrio.l2.disk import DiskBackend, DiskOptions

SIZES = {"2 MiB": 2 << 20, "32 MiB": 32 << 20}
TOTAL = 512 << 20  # bytes moved per measurement
THREADS = 4


def objects(size: int) -> list[tuple[bytes, bytes, np.ndarray, list[memoryview]]]:  # type: ignore[type-arg]
    """(key, header, chunk, destination buffers) per object. The destinations are allocated and
    touched up front, as L1 slots are: loads then measure I/O, not page faults."""
    rng = np.random.default_rng(size)
    count = max(4, TOTAL // size)
    result = []
    for _ in range(count):
        key = os.urandom(32)
        payload = rng.integers(0, 256, size - HEADER_SIZE, dtype=np.uint8)
        into = [memoryview(bytearray(HEADER_SIZE)), memoryview(np.ones_like(payload))]
        result.append((key, header(key, b"f" * 16, memoryview(payload)), payload, into))
    return result


async def disk_round(root: Path, items: list[Any]) -> dict[str, float]:
    backend = DiskBackend(
        DiskOptions(path=str(root / uuid.uuid4().hex), capacity=4 << 30, threads=THREADS)
    )
    limiter = trio.CapacityLimiter(THREADS)
    nbytes = sum(len(h) + p.nbytes for _, h, p, _ in items)

    async def each(fn: Any) -> float:
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for item in items:
                nursery.start_soon(fn, item)
        return nbytes / (time.perf_counter() - started) / 1e9

    async def store(item: Any) -> None:
        key, head, payload, _ = item
        assert await backend.store([key], [[memoryview(head), memoryview(payload)]]) == [True]

    async def load(item: Any) -> None:
        key, _, _, into = item
        assert await backend.load([key], [into]) == [True]

    raw_dir = root / uuid.uuid4().hex
    raw_dir.mkdir()

    def raw_write(path: Path, head: bytes, payload: np.ndarray) -> None:  # type: ignore[type-arg]
        temp = path.with_suffix(".tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.writev(fd, [head, memoryview(payload)])
        finally:
            os.close(fd)
        os.replace(temp, path)

    def raw_read(path: Path, into: list[memoryview]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.readv(fd, into)
        finally:
            os.close(fd)

    async def raw_store(item: Any) -> None:
        key, head, payload, _ = item
        await trio.to_thread.run_sync(
            raw_write, raw_dir / key.hex(), head, payload, limiter=limiter
        )

    async def raw_load(item: Any) -> None:
        key, _, _, into = item
        await trio.to_thread.run_sync(raw_read, raw_dir / key.hex(), into, limiter=limiter)

    result = {
        "store": await each(store),
        "raw_store": await each(raw_store),
        "load": await each(load),
        "raw_load": await each(raw_load),
    }
    await backend.aclose()
    return result


def measure_disk(repeats: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(
        prefix="kvb-disk-", dir=os.environ.get("KVTRIO_BENCH_DIR")
    ) as tmp:
        for label, size in SIZES.items():
            items = objects(size)
            rounds = [trio.run(disk_round, Path(tmp), items) for _ in range(repeats)]
            rows.append(
                {"backend": "disk", "size": label}
                | {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            )
    return rows


def by_size(backend: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of ``backends_redis`` / ``backends_s3`` (one per size and op) as rows of this
    script's table (one per size)."""
    table: dict[int, dict[str, Any]] = {}
    for row in rows:
        line = table.setdefault(
            row["size"], {"backend": backend, "size": f"{row['size'] >> 20} MiB"}
        )
        line[row["op"]] = row["backend_gbps"]
        line["raw_" + row["op"]] = row["raw_gbps"]
    return list(table.values())


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'backend':8}{'object':>8}{'store GB/s':>12}{'raw':>8}{'ratio':>7}"
        f"{'load GB/s':>12}{'raw':>8}{'ratio':>7}"
    )
    for row in rows:
        print(
            f"{row['backend']:8}{row['size']:>8}{row['store']:>12.2f}{row['raw_store']:>8.2f}"
            f"{row['store'] / row['raw_store']:>7.2f}{row['load']:>12.2f}{row['raw_load']:>8.2f}"
            f"{row['load'] / row['raw_load']:>7.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default="disk,redis,s3")
    args = parser.parse_args()
    wanted = set(args.only.split(","))
    rows: list[dict[str, Any]] = []
    if "disk" in wanted:
        rows += measure_disk(args.repeats)
    if "redis" in wanted:
        import backends_redis

        rows += by_size("redis", backends_redis.measure(args.repeats))
    if "s3" in wanted:
        import backends_s3

        rows += by_size("s3", backends_s3.measure(args.repeats))
    print(f"\nL2 backends vs raw I/O: medians of {args.repeats} rounds, {THREADS} at a time\n")
    print_rows(rows)


if __name__ == "__main__":
    main()
