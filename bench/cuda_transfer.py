"""Store and retrieve bandwidth of the CUDA engine, next to a raw cudaMemcpy in the same run.

    python bench/cuda_transfer.py [--repeats 7] [--inner 5] [--kernels extension|torch]

GPU only (exits with a message elsewhere). Workload: LMCache's bench shape: 32 layers, 1024
blocks of 16 tokens, 8 KV heads × 128, float16 (flash_attn layout), chunks of 256 tokens
(16 blocks, 32 MiB), and a small-block case (one 16-token block per chunk, 2 MiB).

* store: ``CopyPipeline.store`` of N chunks (random distinct blocks) into pinned host memory
  (cudaHostRegister'd, as the server's L1), waited on its done event;
* retrieve: ``CopyPipeline.retrieve`` of the same chunks back into other blocks;
* raw: one ``cudaMemcpyAsync`` device → pinned host (and host → device) of the same bytes.

Medians in GB/s and the ratio to raw (target ≥ 0.95 for 32 MiB chunks).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvtrio.transfer import KVLayout
from kvtrio.transfer.cuda import ChunkCopy, CopyPipeline, PinnedHost, TorchDevice, torch_runtime

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 32, 1024, 16, 8, 128
CHUNKS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--kernels", choices=["extension", "torch"], default="extension")
    args = parser.parse_args()
    runtime = torch_runtime()
    if runtime is None:
        sys.exit("bench/cuda_transfer.py needs a CUDA GPU and torch built with CUDA; none here.")
    torch = runtime.torch
    base = runtime.device(0)
    device = base if args.kernels == "extension" else TorchDevice(torch, 0, None)
    if args.kernels == "extension" and base.kernels != "extension":
        sys.exit("the CUDA extension did not build (see the log); try --kernels torch")
    layout = KVLayout("flash_attn", LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, "float16")
    layers = [torch.randn(layout.layer_shape, dtype=torch.float16, device="cuda:0")
              for _ in range(LAYERS)]  # fmt: skip
    prepared = device.prepare_layers(layout, layers)
    print(f"kernels: {device.kernels}; {torch.cuda.get_device_name(0)}")
    for label, blocks_per_chunk in (("32 MiB chunks", 16), ("2 MiB chunks (1 block)", 1)):
        rate = bench_case(runtime, device, prepared, layout, blocks_per_chunk, args)
        print(
            f"{label}: store {rate['store']:.1f} GB/s = {rate['store'] / rate['raw d2h']:.2f} × "
            f"raw d2h {rate['raw d2h']:.1f}; retrieve {rate['retrieve']:.1f} GB/s = "
            f"{rate['retrieve'] / rate['raw h2d']:.2f} × raw h2d {rate['raw h2d']:.1f}"
        )


def bench_case(
    runtime: Any, device: Any, prepared: Any, layout: KVLayout, per_chunk: int, args: Any
) -> dict[str, float]:
    """Median GB/s of store, retrieve and the raw copies for chunks of ``per_chunk`` blocks."""
    torch = runtime.torch
    nbytes = layout.chunk_nbytes(per_chunk * BLOCK_SIZE)
    host = np.zeros(nbytes * CHUNKS, np.uint8)
    pinned = PinnedHost(runtime, host)
    pipeline = CopyPipeline(device, nbytes)
    done = device.new_event()
    rng = np.random.default_rng(0)
    staging = torch.empty(nbytes * CHUNKS, dtype=torch.uint8, device="cuda:0")
    host_tensor = torch.from_numpy(host)
    raw_stream = torch.cuda.Stream()

    def chunks() -> list[ChunkCopy]:
        ids = rng.choice(BLOCKS, per_chunk * CHUNKS, replace=False).tolist()
        return [
            ChunkCopy(tuple(ids[i * per_chunk : (i + 1) * per_chunk]),
                      pinned.pieces(i * nbytes, nbytes))
            for i in range(CHUNKS)
        ]  # fmt: skip

    def timed_pipeline(store: bool) -> float:
        work = chunks()  # drawn outside the timed region
        torch.cuda.synchronize()
        start = time.perf_counter()
        (pipeline.store if store else pipeline.retrieve)(prepared, work, None, done)
        done.synchronize()
        return time.perf_counter() - start

    def timed_raw(store: bool) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(raw_stream):
            if store:
                host_tensor.copy_(staging, non_blocking=True)
            else:
                staging.copy_(host_tensor, non_blocking=True)
        raw_stream.synchronize()
        return time.perf_counter() - start

    ops = {
        "store": lambda: timed_pipeline(True),
        "raw d2h": lambda: timed_raw(True),
        "retrieve": lambda: timed_pipeline(False),
        "raw h2d": lambda: timed_raw(False),
    }
    for op in ops.values():  # warm up
        op()
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(args.repeats):
        for name, op in ops.items():
            samples[name] += [op() for _ in range(args.inner)]
    pinned.close()
    return {name: nbytes * CHUNKS / statistics.median(t) / 1e9 for name, t in samples.items()}


if __name__ == "__main__":
    main()
