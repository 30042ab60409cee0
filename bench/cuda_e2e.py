"""End to end on a GPU: a CUDA engine worker against a real ``kvtrio serve``, next to raw copies.

    python bench/cuda_e2e.py [--repeats 5] [--sizes 16,64,256]

GPU only (exits with a message elsewhere). The worker (``bench/_cuda_serve.py``) holds the
issue's KV shape on GPU 0: 32 layers of flash_attn ``[2, blocks, 16, 8, 128]`` float16, 2 MiB
per 16-token block, and talks to the server as an engine does (``WorkerAdapter``, CUDA IPC).
For each chunk size (2 MiB: 16 tokens; 32 MiB: 256 tokens; one server each) and sequence size
(16, 64, 256 MiB of KV), it stores a new prompt from some blocks, then retrieves it into others,
``--repeats`` times, and prints the median GB/s and latency per request next to a raw
``cudaMemcpyAsync`` of the same bytes (device → pinned host for stores, back for retrieves),
measured in the same run. Target (issue 24): ≥ 0.85 × raw for 64 MiB at 2 MiB chunks. A size
that is not whole chunks (16 MiB at 32 MiB chunks) is left out: it would be stored as a partial
chunk, whose copy writes the whole slot (zeros after its blocks), so it moves more bytes than raw.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import numpy as np
from _cuda_serve import CudaWorker, raw_copy, serve, shm_free

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
BLOCK_BYTES = LAYERS * 2 * 16 * HEADS * HEAD_DIM * 2  # 2 MiB
CHUNKS = {"2 MiB": 16, "32 MiB": 256}  # label: tokens per chunk


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.version.cuda and torch.cuda.is_available() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="16,64,256", help="MiB of KV per request")
    args = parser.parse_args()
    torch = _torch()
    if torch is None:
        sys.exit("bench/cuda_e2e.py needs a CUDA GPU and torch built with CUDA; none here.")
    sizes = [int(s) for s in args.sizes.split(",")]
    fits = [size for size in sizes if (max(2 * size, 64) << 20) + (64 << 20) <= shm_free()]
    if fits != sizes:
        print(f"/dev/shm has {shm_free() >> 20} MiB: {sorted(set(sizes) - set(fits))} MiB "
              "requests do not fit an L1 there and are left out (docker: --shm-size)")  # fmt: skip
        sizes = fits
    if not sizes:
        sys.exit("bench/cuda_e2e.py: no request fits an L1 in /dev/shm")
    blocks = max(sizes) * (1 << 20) // BLOCK_BYTES
    l1 = max(2 * max(sizes), 2 * 32) << 20  # a request beside the next; two 32 MiB chunks
    raw = {size: raw_copy(torch, size << 20, args.repeats) for size in sizes}
    print(f"{torch.cuda.get_device_name(0)}; {LAYERS} layers flash_attn, "
          f"{BLOCK_BYTES >> 20} MiB per block; medians of {args.repeats}")  # fmt: skip
    rng = np.random.default_rng(0)
    for label, tokens in CHUNKS.items():
        with serve(tokens, l1) as server:
            worker = CudaWorker(torch, server.endpoint, LAYERS, 2 * blocks, HEADS, HEAD_DIM,
                                torch.float16)  # fmt: skip
            try:
                for size in sizes:
                    n = size * (1 << 20) // BLOCK_BYTES
                    if n % (tokens // 16):
                        print(f"e2e {size} MiB in {label} chunks: left out (not whole chunks: "
                              "a partial chunk's copy writes the whole slot)")  # fmt: skip
                        continue
                    stores, retrieves = [], []
                    for _ in range(args.repeats + 1):  # the first is a warm-up
                        ids = rng.permutation(2 * blocks)[: 2 * n].tolist()
                        prompt = worker.prompt(n * 16)
                        stores.append(worker.store(prompt, ids[:n]))
                        retrieves.append(worker.retrieve(prompt, ids[n:]))
                    store, retrieve = (
                        statistics.median(stores[1:]),
                        statistics.median(retrieves[1:]),
                    )
                    d2h, h2d = raw[size]
                    gb = (size << 20) / 1e9
                    print(
                        f"e2e {size} MiB in {label} chunks: store {gb / store:.1f} GB/s "
                        f"({store * 1e3:.2f} ms) = {d2h / store:.2f} × raw d2h {gb / d2h:.1f}; "
                        f"retrieve {gb / retrieve:.1f} GB/s ({retrieve * 1e3:.2f} ms) = "
                        f"{h2d / retrieve:.2f} × raw h2d {gb / h2d:.1f}"
                    )
            finally:
                worker.close()


if __name__ == "__main__":
    main()
