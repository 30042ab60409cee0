"""Store and retrieve bandwidth of the CUDA engine per chunk size, next to raw cudaMemcpy.

    python bench/cuda_transfer.py [--kernels extension|torch] [--repeats 7] [--inner 5]
                                  [--profile DIR]

GPU only (exits with a message elsewhere). Workload: the issue's shape (LMCache's bench): 32
layers of flash_attn ``[2, 1024, 16, 8, 128]`` float16, 8 chunks per operation of random
distinct blocks, chunks of 1, 2, 4, 8 and 16 blocks (2 to 32 MiB), the GPU's L2 cache flushed
before each operation (a 256 MiB write), the host side pinned as the server's L1 is.

* store: ``CopyPipeline.store`` of the operation into pinned host memory, waited on its done
  event; retrieve: ``CopyPipeline.retrieve`` of the same chunks back into other blocks;
* raw: one ``cudaMemcpyAsync`` device → pinned host (and host → device) of the same bytes;
* enqueue: host time from the call until the pipeline returns (building the descriptors, the
  launch, the event record): what the engine's thread pays before the GPU starts.

``--kernels extension`` runs both modes of the compiled kernels (``mapped``: zero-copy into the
mapped host memory, one launch; ``staged``: staging buffers and the copy engine); ``torch`` runs
the pure-torch fallback (staged). Per mode, a sweep row per chunk size (medians in GB/s, the
ratio to raw), then the per-operation constant (one chunk of one block: time above the raw copy
of the same bytes) and the enqueueing cost of an operation and of each extra chunk. Targets
(issue 24): ≥ 0.90 × raw at 2 MiB and ≥ 0.95 × at 16–32 MiB with the extension, ≥ 0.5 × at
2 MiB with the fallback; enqueueing ≤ 20 µs per operation and ≤ 2 µs per extra chunk.
``--profile DIR`` also writes a torch profiler trace of a few 2 MiB-chunk operations per mode.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvtrio.transfer import KVLayout
from kvtrio.transfer.cuda import (
    CopyPipeline,
    Operation,
    PinnedHost,
    TorchDevice,
    page_aligned,
    torch_runtime,
)

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 32, 1024, 16, 8, 128
CHUNKS = 8
SWEEP = (1, 2, 4, 8, 16)
FLUSH_BYTES = 256 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--kernels", choices=["extension", "torch"], default="extension")
    parser.add_argument("--profile", type=Path, help="write torch profiler traces here")
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
    block_bytes = layout.chunk_nbytes(BLOCK_SIZE)
    host = PinnedHost(device, page_aligned(block_bytes * max(SWEEP) * CHUNKS))
    bench = Bench(torch, device, prepared, host, block_bytes, args)
    print(f"kernels: {device.kernels}; {torch.cuda.get_device_name(0)}; {LAYERS} layers, "
          f"{CHUNKS} chunks per operation, L2 flushed before each")  # fmt: skip
    try:
        for mode in device.modes:
            if mode == "mapped":
                host.map(0, device.mapped_address)
            for blocks in SWEEP:
                rate = bench.case(mode, blocks)
                print(
                    f"{mode} {blocks} blocks ({blocks * block_bytes >> 20} MiB chunks): store "
                    f"{rate['store']:.1f} GB/s = {rate['store'] / rate['raw d2h']:.2f} × raw d2h "
                    f"{rate['raw d2h']:.1f}; retrieve {rate['retrieve']:.1f} GB/s = "
                    f"{rate['retrieve'] / rate['raw h2d']:.2f} × raw h2d {rate['raw h2d']:.1f}; "
                    f"enqueue store {rate['enqueue store']:.1f} µs, retrieve "
                    f"{rate['enqueue retrieve']:.1f} µs"
                )
            one = bench.constant(mode)
            print(
                f"{mode} constant: one 1-block chunk: store {one['store']:.1f} µs (raw "
                f"{one['raw d2h']:.1f}), retrieve {one['retrieve']:.1f} µs (raw "
                f"{one['raw h2d']:.1f}); enqueue per operation {one['enqueue']:.1f} µs, per "
                f"extra chunk {one['per chunk']:.2f} µs"
            )
            if args.profile:
                bench.profile(mode, args.profile)
    finally:
        host.close()


class Bench:
    """One device's measurements (see the module doc)."""

    def __init__(
        self, torch: Any, device: Any, prepared: Any, host: PinnedHost, block_bytes: int, args: Any
    ) -> None:
        self.torch, self.device, self.prepared, self.host = torch, device, prepared, host
        self.block_bytes = block_bytes
        self.args = args
        self.rng = np.random.default_rng(0)
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda:0")
        self.staging = torch.empty(host.memory.nbytes, dtype=torch.uint8, device="cuda:0")
        self.host_tensor = torch.from_numpy(host.memory)
        self.raw_stream = torch.cuda.Stream()
        self.pipelines: dict[tuple[str, int], CopyPipeline] = {}

    def pipeline(self, mode: str, blocks: int) -> CopyPipeline:
        key = (mode, blocks)
        if key not in self.pipelines:
            chunk = blocks * self.block_bytes
            self.pipelines[key] = CopyPipeline(self.device, chunk, mode=mode,
                                               staging_bytes=max(chunk, 32 << 20))  # fmt: skip
        return self.pipelines[key]

    def slots(self, blocks: int, chunks: int = CHUNKS) -> list[tuple[list[int], int, int]]:
        ids = self.rng.choice(BLOCKS, blocks * chunks, replace=False).tolist()
        nbytes = blocks * self.block_bytes
        return [(ids[i * blocks : (i + 1) * blocks], i * nbytes, nbytes) for i in range(chunks)]

    def _fresh(self) -> None:
        self.flush.zero_()  # evict the GPU's L2: an operation reads cold engine blocks
        self.torch.cuda.synchronize()

    def timed_op(
        self, mode: str, blocks: int, store: bool, chunks: int = CHUNKS
    ) -> tuple[float, float]:
        """(seconds until done, seconds until the pipeline returned) of one operation."""
        pipeline, done = self.pipeline(mode, blocks), self.device.new_event()
        slots = self.slots(blocks, chunks)  # drawn outside the timed region
        self._fresh()
        start = time.perf_counter()
        op = Operation.of(slots)
        (pipeline.store if store else pipeline.retrieve)(self.prepared, op, self.host, None, done)
        queued = time.perf_counter()
        done.synchronize()
        return time.perf_counter() - start, queued - start

    def timed_raw(self, nbytes: int, store: bool) -> float:
        self._fresh()
        start = time.perf_counter()
        with self.torch.cuda.stream(self.raw_stream):
            if store:
                self.host_tensor[:nbytes].copy_(self.staging[:nbytes], non_blocking=True)
            else:
                self.staging[:nbytes].copy_(self.host_tensor[:nbytes], non_blocking=True)
        self.raw_stream.synchronize()
        return time.perf_counter() - start

    def samples(self, ops: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
        for op in ops.values():  # warm up
            op()
        got: dict[str, list[Any]] = {name: [] for name in ops}
        for _ in range(self.args.repeats):  # interleaved: drifts hit every op alike
            for name, op in ops.items():
                got[name] += [op() for _ in range(self.args.inner)]
        return got

    def case(self, mode: str, blocks: int) -> dict[str, float]:
        """Median GB/s of store, retrieve and the raw copies; median enqueue µs."""
        nbytes = blocks * self.block_bytes * CHUNKS
        got = self.samples({
            "store": lambda: self.timed_op(mode, blocks, True),
            "raw d2h": lambda: self.timed_raw(nbytes, True),
            "retrieve": lambda: self.timed_op(mode, blocks, False),
            "raw h2d": lambda: self.timed_raw(nbytes, False),
        })  # fmt: skip
        rate = {}
        for name, values in got.items():
            seconds = [v[0] if isinstance(v, tuple) else v for v in values]
            rate[name] = nbytes / statistics.median(seconds) / 1e9
        for name in ("store", "retrieve"):
            rate[f"enqueue {name}"] = statistics.median(v[1] for v in got[name]) * 1e6
        return rate

    def constant(self, mode: str) -> dict[str, float]:
        """One chunk of one block (µs), next to raw; enqueueing per operation and per chunk."""
        got = self.samples({
            "store": lambda: self.timed_op(mode, 1, True, 1),
            "raw d2h": lambda: self.timed_raw(self.block_bytes, True),
            "retrieve": lambda: self.timed_op(mode, 1, False, 1),
            "raw h2d": lambda: self.timed_raw(self.block_bytes, False),
            "eight": lambda: self.timed_op(mode, 1, True, 8),
        })  # fmt: skip
        med = {name: statistics.median(v[0] if isinstance(v, tuple) else v for v in values) * 1e6
               for name, values in got.items()}  # fmt: skip
        one = statistics.median(v[1] for v in got["store"]) * 1e6
        eight = statistics.median(v[1] for v in got["eight"]) * 1e6
        return {**med, "enqueue": one, "per chunk": (eight - one) / 7}

    def profile(self, mode: str, directory: Path) -> None:
        """A torch profiler trace (CPU and CUDA) of three 2 MiB-chunk stores and retrieves."""
        from torch.profiler import ProfilerActivity, profile

        directory.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities) as trace:
            for _ in range(3):
                self.timed_op(mode, 1, True)
                self.timed_op(mode, 1, False)
        path = directory / f"cuda_transfer-{self.device.kernels}-{mode}.json"
        trace.export_chrome_trace(str(path))
        print(f"{mode} profile: {path}")


if __name__ == "__main__":
    main()
