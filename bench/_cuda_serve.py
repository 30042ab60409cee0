"""A real ``kvtrio serve`` and a CUDA engine worker for the GPU benches (cuda_e2e, cuda_prefill).

:func:`serve` starts a server process (ipc socket in a temporary directory, no L2);
:class:`CudaWorker` holds a paged KV cache on GPU 0 (flash_attn layout, the shape given),
registers it through :class:`kvtrio.client.WorkerAdapter` (CUDA IPC) and times stores and
retrieves as the engine sees them: from the submit until the adapter's future is done (the
server's copy is complete and, for a store, its chunks are committed). :func:`raw_copy` times a
plain ``cudaMemcpyAsync`` of the same bytes between the GPU and pinned host memory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtrio.client import LoadStoreOp, WorkerAdapter
from kvtrio.launch import ServerProcess

__all__ = ["CudaWorker", "raw_copy", "serve", "shm_free"]

BLOCK = 16


def shm_free(directory: str = "/dev/shm") -> int:
    """Free bytes in the shared-memory directory the server's L1 lives in."""
    return shutil.disk_usage(directory).free


@contextlib.contextmanager
def serve(chunk_tokens: int, l1_bytes: int) -> Iterator[ServerProcess]:
    """A ``kvtrio serve`` with ``chunk_tokens`` per chunk and ``l1_bytes`` of L1; its log is
    printed if it fails to start. Stopped (gracefully) on exit."""
    with tempfile.TemporaryDirectory(prefix="kvtrio-bench-") as directory:
        log = Path(directory) / "server.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVTRIO_L2": "none"}
        server = ServerProcess(
            f"ipc://{directory}/s.sock",
            ["--chunk-size", str(chunk_tokens), "--l1-size", str(l1_bytes)],
            env,
            log_path=log,
        )
        server.start(timeout=60)
        try:
            yield server
        finally:
            server.stop()


class CudaWorker:
    """A paged KV cache on GPU 0 registered with a server (see the module doc)."""

    def __init__(
        self, torch: Any, endpoint: str, layers: int, blocks: int, heads: int, head_dim: int,
        dtype: Any, device: str = "cuda:0",
    ) -> None:  # fmt: skip
        """``device`` ``cpu`` makes it a CPU worker (copies through the arena): a smoke test of
        this module where there is no GPU."""
        self.torch = torch
        self.device = device
        self.tensors = [
            torch.randn((2, blocks, BLOCK, heads, head_dim), device=device).to(dtype)
            for _ in range(layers)
        ]
        self.block_bytes = layers * 2 * BLOCK * heads * head_dim * self.tensors[0].element_size()
        self.adapter = WorkerAdapter(endpoint, "bench", 1, 0, BLOCK, timeout=120)
        kv = {f"model.layers.{i}.self_attn": t for i, t in enumerate(self.tensors)}
        self.adapter.register_kv_caches(kv, layout="flash_attn")
        deadline = time.monotonic() + 300  # a first registration may build the extension
        while not self.adapter.registered:
            if time.monotonic() > deadline:
                raise RuntimeError("the worker did not register within 300 s")
            time.sleep(0.05)
        self._prompt = 0

    def prompt(self, tokens: int) -> list[int]:
        """A prompt no earlier call returned (its chunks are not in the cache yet)."""
        self._prompt += 1
        return [self._prompt * 1_000_003 + i for i in range(tokens)]

    def _synchronize(self) -> None:
        if self.device != "cpu":
            self.torch.cuda.synchronize()

    def store(self, prompt: list[int], blocks: list[int]) -> float:
        """Seconds until the store of ``prompt`` from ``blocks`` is done (committed)."""
        self._synchronize()
        start = time.perf_counter()
        op = LoadStoreOp(blocks, prompt, end=len(prompt))
        self.adapter.submit_store_request(f"s{self._prompt}", op).result(120)
        return time.perf_counter() - start

    def retrieve(self, prompt: list[int], blocks: list[int]) -> float:
        """Seconds until ``prompt``'s KV is in ``blocks`` (``RuntimeError`` if any failed)."""
        self._synchronize()
        start = time.perf_counter()
        op = LoadStoreOp(blocks, prompt, end=len(prompt))
        self.adapter.submit_retrieve_request(f"r{self._prompt}", op).result(120)
        seconds = time.perf_counter() - start
        failed = self.adapter.get_block_ids_with_load_errors()
        if failed:
            raise RuntimeError(f"{len(failed)} blocks failed to load (see the server's log)")
        return seconds

    def close(self) -> None:
        self.adapter.shutdown()


def raw_copy(torch: Any, nbytes: int, repeats: int) -> tuple[float, float]:
    """Median seconds of one ``cudaMemcpyAsync`` of ``nbytes`` device → pinned host and back."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats + 1):
        for d2h in (True, False):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.cuda.stream(stream):
                (host if d2h else device).copy_(device if d2h else host, non_blocking=True)
            stream.synchronize()
            times[d2h].append(time.perf_counter() - start)
    return statistics.median(times[True][1:]), statistics.median(times[False][1:])
