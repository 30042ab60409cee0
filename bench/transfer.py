"""Gather and scatter of one chunk on the CPU copy path, next to a plain memcpy in the same run.

    python bench/transfer.py [--shape lmcache|smollm2] [--rounds 40] [--numpy]
                             [--isa scalar|sse2|avx2] [--prefetch l1|l2] [--kinds ...]

Shapes (``--shape``):

* ``lmcache`` (default): LMCache's ``lmcache bench server``: 32 layers, 1024 blocks of 16 tokens,
  8 KV heads × 128 head dim, float16, chunks of 256 tokens (16 blocks, 32 MiB);
* ``smollm2``: SmolLM2-135M on vLLM's CPU backend: 30 layers, 1024 blocks of 32 tokens, 3 KV
  heads × 64 head dim, float32, chunks of 256 tokens (8 blocks, 11.25 MiB).

``mla`` has one latent head, of ``2 × heads × head_dim``, so that its chunks have the same bytes.

For each layout kind, one at a time (KV tensors of 1.4-2 GiB and the arena, allocated and
touched first):

* gather: random distinct blocks of every layer into a random slot of a 1 GiB shared-memory
  arena (page aligned, as in the server; the layers are numpy arrays, 16 bytes past a page);
* scatter: a random slot into random distinct blocks;
* memcpy in / memcpy out: ``np.copyto`` of the same number of bytes from / to a random
  contiguous span of the same KV tensors, to / from a random slot: the same memory, as far from
  the cache, on both sides as the copy it is compared with (the ratios are gather ÷ memcpy in
  and scatter ÷ memcpy out). A chunk that a retrieve scatters was written long before, so its
  slot is not in the cache: the slots rotate through more memory than an L3 holds;
* hot memcpy: ``np.copyto`` between the same two buffers every time (the baseline before issue
  23: where the L3 is big and quiet both stay in it, which flatters memcpy, and the copies were
  compared with it; shown for reference only).

Each of ``--rounds`` rounds times one copy of each of the five, in a random order (fresh block
ids, slots and spans every copy). Speeds are medians over the rounds in GB/s (10⁹ bytes/s); a
ratio is the median of the rounds' ratios (the copy and its memcpy timed in the same round, so
that a neighbour's burst slows both; target ≥ 0.8). These machines are shared and noisy:
compare ratios, not GB/s across runs, and take the median of several runs.

The copies use kvtrio's C helper when it can be built (the first run builds it), numpy with
``--numpy`` (which sets ``KVTRIO_NO_EXT=1``); the header says which, with the instruction set
the helper uses (``--isa`` caps it), where its prefetches bring lines (L2 on AMD, L1 elsewhere;
``--prefetch`` chooses) and the CPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtrio.shm import SharedArena
from kvtrio.transfer import LAYOUT_KINDS, KVLayout, cpu_helper, gather, scatter

# name: (layers, blocks, block size, heads, head dim, dtype, chunk tokens)
SHAPES: dict[str, tuple[int, int, int, int, int, str, int]] = {
    "lmcache": (32, 1024, 16, 8, 128, "float16", 256),
    "smollm2": (30, 1024, 32, 3, 64, "float32", 256),
}
OPS = ("gather", "scatter", "memcpy_in", "memcpy_out", "memcpy_hot")
NUMPY_DTYPES = {1: np.uint8, 2: np.float16, 4: np.float32}
ARENA_BYTES = 1 << 30


def make_layout(kind: str, shape: str) -> KVLayout:
    """The layout of ``kind`` for the named shape (``mla``: one head of all the bytes)."""
    layers, blocks, block_size, heads, dim, dtype, _ = SHAPES[shape]
    heads, dim = (1, 2 * heads * dim) if kind == "mla" else (heads, dim)
    return KVLayout(kind, layers, blocks, block_size, heads, dim, dtype)


def timed(fn: Callable[..., object], *args: Any) -> float:
    """Seconds that ``fn(*args)`` takes."""
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def bench_kind(kind: str, shape: str, rounds: int, rng: np.random.Generator) -> dict[str, float]:
    """Median GB/s of each of :data:`OPS` for one layout kind, and the median ratios
    ``gather/in`` and ``scatter/out``."""
    layout = make_layout(kind, shape)
    chunk_tokens = SHAPES[shape][-1]
    nbytes = layout.chunk_nbytes(chunk_tokens)
    blocks = chunk_tokens // layout.block_size
    dtype = NUMPY_DTYPES[layout.element_size]
    # np.ones touches every page: untouched memory would read as the shared zero page.
    layers = [np.ones(layout.layer_shape, dtype) for _ in range(layout.num_layers)]
    flat = [layer.reshape(-1).view(np.uint8) for layer in layers]
    if nbytes > flat[0].size:
        raise SystemExit(f"a chunk ({nbytes} bytes) must fit in one layer for the memcpy spans")
    slots = max(4, ARENA_BYTES // nbytes)
    arena = SharedArena.create(slots * nbytes)
    arena.preallocate()
    arena.buffer[:] = 1
    hot_src, hot_dst = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)

    # Random slots and spans are drawn outside the timed region.
    def slot() -> npt.NDArray[np.uint8]:
        start = int(rng.integers(slots)) * nbytes
        return arena.buffer[start : start + nbytes]

    def span() -> npt.NDArray[np.uint8]:
        """A random page-aligned span of chunk size in a random layer."""
        layer = flat[int(rng.integers(len(flat)))]
        start = int(rng.integers((layer.size - nbytes) // 4096 + 1)) * 4096
        return layer[start : start + nbytes]

    def sample(op: str) -> float:
        if op == "memcpy_hot":
            return timed(np.copyto, hot_dst, hot_src)
        if op == "memcpy_in":
            return timed(np.copyto, slot(), span())
        if op == "memcpy_out":
            return timed(np.copyto, span(), slot())
        block_ids = rng.choice(layout.num_blocks, blocks, replace=False)
        return timed(gather if op == "gather" else scatter, layout, layers, block_ids, slot())

    try:
        for op in OPS:  # warm up
            sample(op)
        samples: dict[str, list[float]] = {op: [] for op in OPS}
        for _ in range(rounds):
            for op in rng.permutation(OPS):
                samples[str(op)].append(sample(str(op)))
    finally:
        arena.close()
    result = {op: nbytes / statistics.median(times) / 1e9 for op, times in samples.items()}
    for name, op, base in (("gather/in", "gather", "memcpy_in"),
                           ("scatter/out", "scatter", "memcpy_out")):  # fmt: skip
        pairs = zip(samples[base], samples[op], strict=True)
        result[name] = statistics.median(b / t for b, t in pairs)
    return result


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    """Run the bench for the chosen kinds and print a table of GB/s and ratios."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="lmcache")
    parser.add_argument("--rounds", type=int, default=40, help="copies of each op")
    parser.add_argument("--kinds", nargs="+", choices=LAYOUT_KINDS, default=list(LAYOUT_KINDS))
    parser.add_argument("--numpy", action="store_true", help="copy with numpy, not the C helper")
    parser.add_argument("--isa", help="cap the C helper's instruction set (scalar, sse2, avx2)")
    parser.add_argument("--prefetch", choices=("l1", "l2"), help="the C helper's prefetch level")
    args = parser.parse_args()
    if args.numpy:
        os.environ["KVTRIO_NO_EXT"] = "1"
    helper = cpu_helper()
    if helper is None:
        path = "numpy"
    elif hasattr(helper, "isa"):  # helpers before issue 23 have one instruction set
        path = f"C helper ({helper.isa(args.isa)})"
    else:
        path = "C helper"
    if helper is not None and hasattr(helper, "prefetch"):  # (since issue 33)
        path = path.replace(")", f", prefetch into {helper.prefetch(args.prefetch).upper()})")

    rng = np.random.default_rng(0)
    results = {}
    for kind in args.kinds:
        results[kind] = bench_kind(kind, args.shape, args.rounds, rng)
        print(f"{kind} done", file=sys.stderr)

    layers, blocks, block_size, heads, dim, dtype, tokens = SHAPES[args.shape]
    mib = make_layout("flash_attn", args.shape).chunk_nbytes(tokens) / (1 << 20)
    print(
        f"\ntransfer bench ({args.shape}): {layers} layers × {blocks} blocks × {block_size} "
        f"tokens, {heads} heads × {dim}, {dtype} (mla: 1 × {2 * heads * dim}); chunk {tokens} "
        f"tokens = {mib:g} MiB"
    )
    print(
        f"copies by {path}; CPU {cpu_model()}; numpy {np.__version__}; medians of "
        f"{args.rounds} rounds, GB/s\n"
    )
    header = ("kind", "gather", "scatter", "memcpy in", "memcpy out", "hot memcpy")
    print(f"{header[0]:12}" + "".join(f"{h:>11}" for h in header[1:]) + "   gather/in  scatter/out")
    for kind, row in results.items():
        print(
            f"{kind:12}" + "".join(f"{row[op]:>11.2f}" for op in OPS)
            + f"{row['gather/in']:>12.2f}{row['scatter/out']:>13.2f}"
        )  # fmt: skip


if __name__ == "__main__":
    main()
