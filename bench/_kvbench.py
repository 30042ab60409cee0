"""Pieces shared by ``bench/e2e.py`` and its ``--scaling`` part: a ``kvtrio serve`` process,
KV caches allocated as engines allocate them, and a clock of the worker's copies."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvtrio.client import Client
from kvtrio.launch import ServerProcess
from kvtrio.protocol import GetStats, StatsReply
from kvtrio.transfer import CpuTransfer

BLOCKS, BLOCK, HEADS, DIM = 1024, 16, 8, 128
CHUNK = 256


class CopyClock:
    """Seconds the worker spent in gather/scatter since the last :meth:`take`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spent = 0.0

    def wrap(self, fn: Callable[..., None]) -> Callable[..., None]:
        def timed(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            try:
                fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._spent += time.perf_counter() - start

        return timed

    def take(self) -> float:
        with self._lock:
            spent, self._spent = self._spent, 0.0
        return spent


@contextlib.contextmanager
def timed_copies(clock: CopyClock) -> Iterator[None]:
    """Time the worker's copies while inside: the CPU copy engine's gather and scatter, which
    the worker's arena copy path calls for every chunk."""
    originals = {fn: getattr(CpuTransfer, fn) for fn in ("gather", "scatter")}
    for fn, original in originals.items():
        setattr(CpuTransfer, fn, clock.wrap(original))
    try:
        yield
    finally:
        for fn, original in originals.items():
            setattr(CpuTransfer, fn, original)


def poll(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the operation did not finish")
        time.sleep(0.0002)


def make_cache(
    kind: str, rng: np.random.Generator, layers: int, blocks: int = BLOCKS
) -> tuple[dict[str, Any], list[np.ndarray]]:  # type: ignore[type-arg]
    """The engine's KV tensors (flash_attn layout) and numpy views of them (to check bytes):
    numpy arrays (16 bytes past a page, as numpy aligns) or torch tensors (64-byte aligned)."""
    shape = (2, blocks, BLOCK, HEADS, DIM)
    if kind == "numpy":
        arrays = []
        for _ in range(layers):
            array = np.empty(shape, np.float16)
            array.view(np.uint16)[...] = rng.integers(0, 2**16, shape, dtype=np.uint16)
            arrays.append(array)
        return {f"layer.{i}": a for i, a in enumerate(arrays)}, arrays
    import torch

    tensors = []
    for _ in range(layers):
        tensor = torch.empty(shape, dtype=torch.float16)
        tensor.view(torch.int16).numpy()[...] = rng.integers(-(2**15), 2**15, shape, np.int16)
        tensors.append(tensor)
    views = [t.view(torch.int16).numpy() for t in tensors]
    return {f"layer.{i}": t for i, t in enumerate(tensors)}, views


class _FaultServerProcess(ServerProcess):
    """``kvtrio serve`` through ``_serve_with_fault.py``: the test backend ``fault`` usable."""

    @property
    def command(self) -> list[str]:
        script = str(Path(__file__).with_name("_serve_with_fault.py"))
        return [self.python, script, "serve", "--endpoint", self.endpoint, *self.args]


class Server:
    """A ``kvtrio serve`` process (:class:`kvtrio.launch.ServerProcess`) on an ipc endpoint
    of its own; :meth:`restart` keeps the endpoint (and the options, so a disk L2 keeps its
    objects)."""

    def __init__(self, *options: str, home: str | None = None) -> None:
        self.directory = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
        env = {**os.environ, "KVTRIO_LOG_LEVEL": "warning"}
        if home is not None:  # HOME of the server (where a backend's default paths go)
            env["HOME"] = home
        # (a ``fault:`` L2, the test backend that adds latency, needs it registered)
        kind = _FaultServerProcess if any("fault:" in o for o in options) else ServerProcess
        self.process = kind(f"ipc://{self.directory}/kvtrio.sock", options, env)
        self.endpoint = self.process.endpoint

    def start(self) -> None:
        self.process.start(timeout=120.0)

    def stop(self) -> None:
        self.process.stop()

    def restart(self) -> None:
        self.stop()
        self.start()

    def stats(self) -> StatsReply:
        with Client(self.endpoint, heartbeat=False) as client:
            return client.call(GetStats(), StatsReply)

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
