"""The end-to-end tests' parts: an engine worker process driven over a pipe, the prompt they
store and retrieve, and what they read of the server."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvtrio.client import Client, SchedulerAdapter
from kvtrio.launch import ServerProcess
from kvtrio.protocol import GetStats, StatsReply
from kvtrio.storage import token_chunk_hashes

from .waiting import wait_for

__all__ = [
    "BLOCK",
    "CHUNK",
    "HASHES",
    "PER_CHUNK",
    "PROMPT",
    "SERVER_ARGS",
    "SOURCE",
    "TARGET",
    "Worker",
    "assert_same_bytes",
    "cache",
    "chunk_blocks",
    "lookup",
    "stats",
]

WORKER = Path(__file__).parents[1] / "e2e" / "engine_worker.py"
CHUNK, BLOCK = 256, 16
PER_CHUNK = CHUNK // BLOCK
PROMPT = list(range(5000, 5000 + 10 * CHUNK))  # 10 full chunks
HASHES = tuple(token_chunk_hashes(PROMPT, CHUNK))
SOURCE = list(range(160))  # the blocks the prompt is stored from
TARGET = list(range(255, 95, -1))  # 160 other blocks, in another order, to retrieve into
SERVER_ARGS = ("--l1-size", "64MiB", "--heartbeat-timeout", "1", "--pin-ttl", "30")


class Worker:
    """An engine worker process (``engine_worker.py``) driven over stdin/stdout."""

    def __init__(
        self,
        endpoint: str,
        model: str,
        world: int,
        rank: int,
        layout: str,
        flags: tuple[str, ...],
        env: dict[str, str] | None = None,
    ) -> None:
        """``env``: the process's whole environment (default: this one's)."""
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), endpoint, model, str(world), str(rank), layout, *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self._read() == {"ready": True}

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the worker exited with {self.proc.poll()}"
        return dict(json.loads(line))

    def __call__(self, cmd: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def store(self, request: str, tokens: list[int], blocks: list[int]) -> None:
        self("store", request=request, tokens=tokens, blocks=blocks, end=len(tokens))
        assert self("wait", request=request)["done"]

    def retrieve(
        self, request: str, tokens: list[int], blocks: list[int], end: int, **more: int
    ) -> list[int]:
        """Retrieve tokens ``[0, end)`` (or ``[start, end)``, skipping ``skip`` tokens) into
        ``blocks``; return the blocks that failed."""
        self("retrieve", request=request, tokens=tokens, blocks=blocks, end=end, **more)
        assert self("wait", request=request)["done"]
        return list(self("errors")["blocks"])

    def digests(self, blocks: list[int]) -> list[str]:
        return list(self("digest", blocks=blocks)["digests"])

    def wait_registered(self) -> None:
        wait_for(lambda: self("registered")["registered"], what="the worker to register")

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(AssertionError, BrokenPipeError, OSError):
                self("exit")
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def lookup(
    adapter: SchedulerAdapter, request: str, tokens: list[int] | None = None, **kw: Any
) -> int:
    adapter.maybe_submit_lookup_request(request, token_ids=tokens, **kw)
    wait_for(lambda: adapter.check_lookup_result(request) is not None, what="the lookup")
    hits = adapter.check_lookup_result(request)
    assert hits is not None
    adapter.cleanup_lookup_result(request)
    return hits


def stats(server: ServerProcess) -> StatsReply:
    with Client(server.endpoint, heartbeat=False) as client:
        return client.call(GetStats(), StatsReply)


def cache(server: ServerProcess) -> Any:
    reply = stats(server)
    assert reply.cache is not None
    return reply.cache


def chunk_blocks(blocks: list[int], chunk: int) -> list[int]:
    return blocks[chunk * PER_CHUNK : (chunk + 1) * PER_CHUNK]


def assert_same_bytes(
    worker: Worker, before: list[list[str]], blocks: list[int], chunks: int
) -> None:
    for chunk in range(chunks):
        assert worker.digests(chunk_blocks(blocks, chunk)) == before[chunk], (
            f"chunk {chunk} differs"
        )
