"""Gather and scatter of one chunk on the CPU copy path, next to a plain memcpy in the same run.

    python bench/transfer.py [--repeats 7] [--inner 5] [--numpy]

Workload: the shape of LMCache's ``lmcache bench server``: 32 layers, 1024 blocks of 16 tokens,
8 KV heads × 128 head dim, float16, chunks of 256 tokens (16 blocks, 32 MiB). ``mla`` has one
latent head; it gets a latent dim of 2048 so that its chunks have the same 32 MiB.

For each layout kind, one at a time (2 GiB of KV tensors each, allocated and touched first):

* gather: 16 random distinct blocks of every layer into a slot of a shared-memory arena (page
  aligned, as in the server; the layers are numpy arrays, 16 bytes past a page);
* scatter: that buffer into 16 random distinct blocks;
* memcpy: ``np.copyto`` of the same number of bytes between two preallocated buffers.

The three are interleaved over ``--repeats`` rounds of ``--inner`` copies each (fresh block ids
every copy); medians are reported in GB/s (10⁹ bytes/s), with the ratio to memcpy (target ≥ 0.8).
These machines are shared and noisy: compare ratios within one run, not numbers across runs.

The copies use kvtrio's C helper when it can be built (the first run builds it), numpy with
``--numpy`` (which sets ``KVTRIO_NO_EXT=1``); the header says which.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtrio.shm import SharedArena
from kvtrio.transfer import LAYOUT_KINDS, KVLayout, gather, scatter
from kvtrio.transfer._cpu_native import cpu_helper

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, DTYPE = 32, 1024, 16, 8, 128, "float16"
CHUNK_TOKENS = 256
OPS = ("gather", "scatter", "memcpy")


def make_layout(kind: str) -> KVLayout:
    heads, dim = (1, 2 * HEADS * HEAD_DIM) if kind == "mla" else (HEADS, HEAD_DIM)
    return KVLayout(kind, LAYERS, BLOCKS, BLOCK_SIZE, heads, dim, DTYPE)


def timed(fn: Callable[..., object], *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def bench_kind(kind: str, repeats: int, inner: int, rng: np.random.Generator) -> dict[str, float]:
    """Median GB/s of gather, scatter and memcpy for one layout kind."""
    layout = make_layout(kind)
    nbytes = layout.chunk_nbytes(CHUNK_TOKENS)
    blocks = CHUNK_TOKENS // BLOCK_SIZE
    # np.ones touches every page: untouched memory would read as the shared zero page.
    layers = [np.ones(layout.layer_shape, np.float16) for _ in range(LAYERS)]
    arena = SharedArena.create(nbytes)
    arena.preallocate()
    slot = arena.buffer[:nbytes]
    slot[:] = 1
    copy_src, copy_dst = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)

    def sample(op: str) -> float:
        if op == "memcpy":
            return timed(np.copyto, copy_dst, copy_src)
        block_ids = rng.choice(BLOCKS, blocks, replace=False)  # drawn outside the timed region
        return timed(gather if op == "gather" else scatter, layout, layers, block_ids, slot)

    try:
        for op in OPS:  # warm up
            sample(op)
        samples: dict[str, list[float]] = {op: [] for op in OPS}
        for _ in range(repeats):
            for op in OPS:
                samples[op] += [sample(op) for _ in range(inner)]
    finally:
        arena.close()
    return {op: nbytes / statistics.median(times) / 1e9 for op, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--inner", type=int, default=5, help="copies of each kind per round")
    parser.add_argument("--kinds", nargs="+", choices=LAYOUT_KINDS, default=list(LAYOUT_KINDS))
    parser.add_argument("--numpy", action="store_true", help="copy with numpy, not the C helper")
    args = parser.parse_args()
    if args.numpy:
        os.environ["KVTRIO_NO_EXT"] = "1"
    path = "C helper" if cpu_helper() is not None else "numpy"

    rng = np.random.default_rng(0)
    results = {}
    for kind in args.kinds:
        results[kind] = bench_kind(kind, args.repeats, args.inner, rng)
        print(f"{kind} done", file=sys.stderr)

    mib = make_layout("flash_attn").chunk_nbytes(CHUNK_TOKENS) >> 20
    print(
        f"\ntransfer bench: {LAYERS} layers × {BLOCKS} blocks × {BLOCK_SIZE} tokens, "
        f"{HEADS} heads × {HEAD_DIM}, {DTYPE} (mla: 1 × {2 * HEADS * HEAD_DIM}); "
        f"chunk {CHUNK_TOKENS} tokens = {mib} MiB"
    )
    print(
        f"copies by {path}; numpy {np.__version__}; OPENBLAS_CORETYPE="
        f"{os.environ.get('OPENBLAS_CORETYPE', '(unset)')}; "
        f"medians of {args.repeats * args.inner} copies each "
        f"({args.repeats} rounds × {args.inner}), GB/s\n"
    )
    print(
        f"{'kind':14}{'gather':>9}{'scatter':>9}{'memcpy':>9}{'gather/memcpy':>16}{'scatter/memcpy':>16}"
    )
    for kind, row in results.items():
        print(
            f"{kind:14}{row['gather']:>9.2f}{row['scatter']:>9.2f}{row['memcpy']:>9.2f}"
            f"{row['gather'] / row['memcpy']:>16.2f}{row['scatter'] / row['memcpy']:>16.2f}"
        )


if __name__ == "__main__":
    main()
