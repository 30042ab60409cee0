"""Host (Python) cost of queueing one CUDA operation, on a null device: no GPU needed.

    python bench/cuda_host_cost.py [--baseline REV] [--repeats 7] [--ops 2000]

What the server's CUDA path does per store, from the request's slots to the done event's record
(``CudaTransfers.submit`` minus the event bookkeeping): build the operation's descriptors and
queue it on a ``CopyPipeline`` whose device does nothing (launches, copies and events are
no-ops), so what is measured is kvtrio's own Python work per operation and per extra chunk, in
both modes (``mapped``: zero-copy, one launch; ``staged``: staging buffers and the copy
engine). On a GPU the driver's share comes on top: the table counts the device calls
(launches, copies, event records and waits, each a driver call of several µs) per operation;
the kit's ``bench/cuda_transfer.py`` measures the whole enqueueing there.

``--baseline REV`` also measures the pipeline of git revision REV (extracted to a temporary
directory and run in a subprocess, same machine, same run) so the table shows before and after.
Medians of ``--repeats`` rounds of ``--ops`` operations; chunks of one 2 MiB block each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CHUNK_BYTES = 2 << 20
COUNTS = (1, 2, 8, 32)
CALLS = [0]
"""Device calls queued so far (launches, copies, event records and waits): each is a driver
call on a GPU, several microseconds of host time that the null device does not cost."""


def _call() -> None:
    CALLS[0] += 1


class _Event:
    def record(self, stream: Any = None) -> None:
        _call()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def ipc_handle(self) -> bytes:
        return b""


class _Stream:
    def wait_event(self, event: Any) -> None:
        _call()


class NullDevice:
    """A device whose work costs nothing: only kvtrio's host cost remains."""

    ordinal = 0
    kernels = "null"
    modes = ("mapped", "staged")

    def new_stream(self) -> _Stream:
        return _Stream()

    def new_event(self) -> _Event:
        return _Event()

    def open_event(self, handle: bytes) -> _Event:
        return _Event()

    def new_buffer(self, nbytes: int) -> Any:
        return None

    def buffer_address(self, buffer: Any) -> int:
        return 1 << 40

    def mapped_address(self, host_address: int) -> int:
        return host_address

    def pin(self, memory: Any) -> int:
        return int(memory.__array_interface__["data"][0])

    def unpin(self, token: Any) -> None:
        pass

    def prepare_layers(self, layout: Any, tensors: Any) -> Any:
        return None

    def run(self, *args: Any, **kwargs: Any) -> None:
        _call()

    def upload_ids(self, ids: Any, stream: Any) -> Any:  # the pipeline before issue 24
        _call()
        return ids

    def kernel(self, *args: Any, **kwargs: Any) -> None:  # the pipeline before issue 24
        _call()

    def to_host(self, *args: Any) -> None:
        _call()

    def to_device(self, *args: Any) -> None:
        _call()


def measure(mode: str, repeats: int, ops: int) -> dict[str, float]:
    """Median µs per operation of ``count`` chunks, for each of :data:`COUNTS` (keys ``"1"``,
    ...), and the device calls per operation of each (``"calls 1"``, ...)."""
    from kvtrio.transfer import cuda

    device = NullDevice()
    memory = np.zeros(CHUNK_BYTES * (max(COUNTS) + 1), np.uint8)
    legacy = hasattr(cuda, "ChunkCopy")  # the pipeline before issue 24: one step per chunk
    host = cuda.PinnedHost(device, memory)
    if legacy:
        pipeline = cuda.CopyPipeline(device, CHUNK_BYTES)
    else:
        pipeline = cuda.CopyPipeline(device, CHUNK_BYTES, mode=mode)
        host.map(0, device.mapped_address)
    done = _Event()
    rng = np.random.default_rng(0)
    result = {}
    for count in COUNTS:
        requests = [
            [([int(b)], i * CHUNK_BYTES, CHUNK_BYTES)
             for i, b in enumerate(rng.choice(1024, count, replace=False))]
            for _ in range(16)
        ]  # fmt: skip

        def one(chunks: list[tuple[list[int], int, int]]) -> None:
            if legacy:
                copies = [cuda.ChunkCopy(tuple(ids), host.pieces(offset, nbytes))
                          for ids, offset, nbytes in chunks]  # fmt: skip
                pipeline.store(None, copies, None, done)
            else:
                pipeline.store(None, cuda.Operation.of(chunks), host, None, done)

        for chunks in requests * 10:  # warm up
            one(chunks)
        before = CALLS[0]
        one(requests[0])
        result[f"calls {count}"] = CALLS[0] - before
        rounds = []
        for _ in range(repeats):
            start = time.perf_counter()
            for i in range(ops):
                one(requests[i % len(requests)])
            rounds.append((time.perf_counter() - start) / ops * 1e6)
        result[str(count)] = statistics.median(rounds)
    return result


def baseline(rev: str, mode: str, repeats: int, ops: int) -> dict[str, float]:
    """:func:`measure` on git revision ``rev``'s kvtrio, in a subprocess."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "kvtrio"], capture_output=True, check=True
    ).stdout
    with tempfile.TemporaryDirectory() as tree:
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        code = (
            f"import json, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); "
            "import cuda_host_cost as b, kvtrio; "
            f"assert kvtrio.__file__.startswith({tree!r}), kvtrio.__file__; "
            f"print(json.dumps(b.measure({mode!r}, {repeats}, {ops})))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={"PYTHONPATH": tree, "PATH": "/usr/bin:/bin"}, cwd=tree,  # not this tree's kvtrio
        ).stdout  # fmt: skip
    return {str(k): float(v) for k, v in json.loads(out).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="a git revision to measure beside this tree")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ops", type=int, default=2000)
    args = parser.parse_args()
    rows: dict[str, dict[str, float]] = {}
    if args.baseline:
        rows[f"{args.baseline} (per-chunk pipeline)"] = baseline(
            args.baseline, "staged", args.repeats, args.ops
        )
    for mode in ("mapped", "staged"):
        rows[f"this tree, {mode}"] = measure(mode, args.repeats, args.ops)
    print(f"host µs per store operation (null device; chunks of {CHUNK_BYTES >> 20} MiB), "
          f"medians of {args.repeats} × {args.ops}")  # fmt: skip
    header = "".join(f"{f'{n} chunks':>11}" for n in COUNTS)
    calls = "".join(f"{n:>4}" for n in COUNTS)
    print(f"{'pipeline':<34}{header}{'per extra chunk':>17}   device calls for{calls} chunks")
    for name, values in rows.items():
        first, last = str(COUNTS[0]), str(COUNTS[-1])
        slope = (values[last] - values[first]) / (COUNTS[-1] - COUNTS[0])
        cells = "".join(f"{values[str(n)]:>11.1f}" for n in COUNTS)
        counts = "".join(f"{values[f'calls {n}']:>4.0f}" for n in COUNTS)
        print(f"{name:<34}{cells}{slope:>17.2f}   {'':16}{counts}")


if __name__ == "__main__":
    main()
