"""What zeroing a store's slots costs (kvtrio.server.cache._scrub.Scrubber), next to copying the
same bytes (what the worker does with every slot anyway), in the same run.

    python bench/scrub.py [--repeats 7]

Per chunk size: the median over ``--repeats`` of the best-of-5 time to zero one slot of a
shared-memory arena, and to copy one chunk into it; the ratio zero / copy.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import numpy as np

from kvtrio.shm import SharedArena, default_shm_dir
from kvtrio.storage import Entry, EntryState

SIZES = (32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    arena = SharedArena.create(64 << 20, directory=default_shm_dir(), prefix="kvtrio-scrub")
    source = np.full(16 << 20, 7, dtype=np.uint8)
    try:
        arena.preallocate()
        print(f"{'chunk':>10}{'zero µs':>12}{'copy µs':>12}{'zero/copy':>11}{'GB/s zero':>11}")
        for size in SIZES:
            z, c = measure(arena, source, size, args.repeats)
            print(
                f"{size >> 10:>7} KiB{z * 1e6:>12.1f}{c * 1e6:>12.1f}{z / c:>11.2f}"
                f"{size / z / 1e9:>11.1f}"
            )
    finally:
        arena.close()


def measure(arena: SharedArena, source: np.ndarray, size: int, repeats: int) -> tuple[float, float]:
    """Median seconds to zero one slot of ``size`` bytes, and to copy a chunk into it."""
    from kvtrio.server.cache._scrub import zero as _zero

    entry = Entry(b"k", 0, size, EntryState.WRITING)
    target = arena.view(0, size)
    number = max(1, (64 << 20) // size)
    zero, copy = [], []
    for _ in range(repeats):
        zero.append(min(timeit.repeat(lambda: _zero(arena, [entry]), number=number)) / number)
        copy.append(
            min(timeit.repeat(lambda: np.copyto(target, source[:size]), number=number)) / number
        )
    return statistics.median(zero), statistics.median(copy)


if __name__ == "__main__":
    main()
