"""Write-behind of small chunks to the disk backend: one chunk per backend call vs batches.

    python bench/writebehind.py [--repeats 5] [--chunks 2048] [--chunk-kib 32]

The server's L2 tier (two flushers, a queue of 256) over a ``disk`` backend in a temporary
directory, fed committed L1 chunks of 32 KiB (the chunk size of ``kvtrio bench --trace``'s default
model). Two measurements per variant, interleaved over ``--repeats`` rounds, medians:

- **drain**: ``--chunks`` chunks offered as fast as the queue takes them (never skipped); chunks/s
  until all are written.
- **offered load**: ``--rate`` chunks/s offered for one second in 10 ms bursts, whatever the
  queue holds; how many were skipped (the "not written to L2 (queue full)" of ``kvtrio bench``).

The baseline is the same code with batches of one chunk (``_BATCH_CHUNKS = 1``): one frame
header hop and one ``store([key])`` per chunk, as before batching.

``--names``: the tier's listener names every chunk as the KV events' announcer does (16 engine
block hashes, 256 tokens, a parent, issue 35), so a version that keeps names beside the objects
in the disk L2 encodes and writes them with each chunk (a version without ignores them: run it
with ``PYTHONPATH`` at each version for the cost of the names).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import trio

import kvtrio.server.l2tier._writes as l2_module
from kvtrio.l2.disk import DiskBackend, DiskOptions
from kvtrio.server.l2tier import L2Tier, open_l2_tier
from kvtrio.shm import SharedArena
from kvtrio.storage import Entry, L1Cache

QUEUE = 256
FINGERPRINT = b"f" * 16


def l1_with_chunks(count: int, size: int) -> tuple[SharedArena, L1Cache, list[bytes]]:
    arena = SharedArena.create(count * size + (1 << 20), directory=tempfile.gettempdir())
    l1 = L1Cache(arena.size)
    keys = []
    for i in range(count):
        key = i.to_bytes(4, "big") * 8
        entry = l1.reserve(key, size)
        assert isinstance(entry, Entry), entry
        arena.memory(entry.offset, size)[:] = os.urandom(size)
        l1.commit(key)
        keys.append(key)
    return arena, l1, keys


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` every 0.5 ms (the tier's counters have no event to wait on)."""
    while not condition():  # noqa: ASYNC110
        await trio.sleep(0.0005)


class Names:
    """A tier listener that names every chunk (``--names``): what the announcer would give."""

    def __init__(self) -> None:
        try:
            from kvtrio.protocol import PackedTokens, msgpack_uint32s, pack_tokens
            from kvtrio.server._chunknames import NamesRecord, StoreNames
        except ImportError:  # (a version without names: never asked)
            self.record = None
            return
        tokens = PackedTokens.of(msgpack_uint32s(pack_tokens(range(1000, 1256))))
        hashes = tuple(range(1 << 40, (1 << 40) + 16))
        self.record = NamesRecord(hashes, 16, 1 << 41, tokens, None, StoreNames())

    def names_of(self, key: bytes) -> object:
        return self.record

    def stored(self, *args: object) -> None: ...
    def removed(self, *args: object) -> None: ...
    def seen(self, *args: object) -> None: ...
    def recovered(self, *args: object) -> None: ...


def stored(tier: L2Tier) -> int:
    return int(tier.stats()[0].counters.get("stores", 0))


async def run(
    arena: SharedArena,
    l1: L1Cache,
    keys: list[bytes],
    batch: int,
    rate: int,
    where: str | None,
    names: bool = False,
) -> tuple[float, int, int]:
    """(drain chunks/s, skipped, offered) for one variant in a fresh disk directory."""
    l2_module._BATCH_CHUNKS = batch  # type: ignore[attr-defined,unused-ignore]
    with tempfile.TemporaryDirectory(prefix="kvtrio-wb-", dir=where) as directory:
        disk = DiskBackend(DiskOptions(path=str(Path(directory) / "l2")))
        async with open_l2_tier(
            [("disk", disk)],
            l1,
            arena,
            queue_size=QUEUE,
            flushers=2,
            loaders=4,
            **({"listener": Names()} if names else {}),
        ) as tier:
            await tier.start()
            await disk.lookup_and_lock([])  # (the directory scan is not measured)

            started = time.perf_counter()
            for key in keys:  # drain: never skip (a chunk the queue refused is offered again)
                while True:
                    await until(lambda: tier.writes.queued < QUEUE)
                    refused = tier.writes.skipped_stores
                    tier.writes.write_behind(key, FINGERPRINT)
                    if tier.writes.skipped_stores == refused:
                        break
                    await trio.sleep(0.0005)  # (the tenant's share of the queue is full)
            await until(lambda: stored(tier) >= len(keys))
            drain = len(keys) / (time.perf_counter() - started)

            before, offered = tier.writes.skipped_stores, 0
            per_burst = max(1, rate // 100)
            deadline = trio.current_time() + 1.0
            index = 0
            while trio.current_time() < deadline:
                for _ in range(per_burst):
                    tier.writes.write_behind(keys[index % len(keys)], FINGERPRINT)
                    index += 1
                    offered += 1
                await trio.sleep(0.01)
            skipped = tier.writes.skipped_stores - before
            drained = len(keys) + offered - skipped
            await until(lambda: not tier.writes.queued and stored(tier) >= drained)
    return drain, skipped, offered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=2048)
    parser.add_argument("--chunk-kib", type=int, default=32)
    parser.add_argument("--rate", type=int, default=2000, help="offered chunks/s")
    parser.add_argument("--dir", default=None, help="where the disk backend writes (a tmp dir)")
    parser.add_argument("--names", action="store_true", help="name every chunk (see above)")
    args = parser.parse_args()
    batched = getattr(l2_module, "_BATCH_CHUNKS", 1)  # (1: code from before batching)
    variants = {"batch=1 (baseline)": 1, f"batch≤{batched}": batched}
    arena, l1, keys = l1_with_chunks(args.chunks, args.chunk_kib << 10)
    results: dict[str, list[tuple[float, int, int]]] = {name: [] for name in variants}
    try:
        for _ in range(args.repeats):
            for name, batch in variants.items():
                result = trio.run(run, arena, l1, keys, batch, args.rate, args.dir, args.names)
                results[name].append(result)
    finally:
        arena.close()
    print(
        f"{args.chunks} chunks of {args.chunk_kib} KiB, disk backend in {args.dir or 'tmp'}, "
        f"queue {QUEUE}, 2 flushers, medians of {args.repeats}"
        + (", every chunk named" if args.names else "")
    )
    print(f"{'variant':<20} {'drain chunks/s':>15} {'skipped at ' + str(args.rate) + '/s':>22}")
    medians = {}
    for name, rows in results.items():
        drain = statistics.median(r[0] for r in rows)
        skipped = statistics.median(r[1] / r[2] for r in rows)
        offered = statistics.median(r[2] for r in rows)
        medians[name] = (drain, skipped)
        print(f"{name:<20} {drain:>15.0f} {skipped:>14.0%} of {offered:<6.0f}")
    (base_drain, base_skipped), (new_drain, new_skipped) = medians.values()
    print(
        f"batched / baseline: drain ×{new_drain / base_drain:.2f}, "
        f"skipped {new_skipped:.0%} vs {base_skipped:.0%} of the offered chunks"
    )


if __name__ == "__main__":
    main()
