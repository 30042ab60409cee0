"""A fleet on one machine, for the fleet tests and ``bench/fleet.py``: ``kvtrio serve``
processes that share nothing but their L2 store (each its own endpoint directory, shared-memory
directory, key directory and log, as separate nodes would have), engines on each (worker
processes and scheduler adapters), and prompts whose KV every retrieve checks.

Prompts: :func:`prompt` makes token lists that share a prefix of ``shared`` chunks with every
other prompt of the same ``family`` and then differ. A worker ``compute``s a prompt's KV (a pure
function of the tokens, see ``tests/e2e/engine_worker.py``) into its blocks before storing them,
so a retrieve is checked block by block against the right bytes of *its own* prompt.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from kvtrio.client import SchedulerAdapter
from kvtrio.launch import ServerProcess
from kvtrio.protocol import HASH_SCHEME_TOKENS
from kvtrio.transport import ensure_default_keys

from .e2e import BLOCK, CHUNK, Worker, lookup, stats
from .waiting import wait_for

__all__ = [
    "Fetched",
    "Node",
    "diagnosis",
    "fetch",
    "fleet",
    "l2_counter",
    "prompt",
    "put",
]

SERVER_ARGS = ("--l1-size", "64MiB", "--pin-ttl", "30")


def prompt(family: int, member: int, shared: int, chunks: int) -> list[int]:
    """``chunks`` chunks of tokens: the first ``shared`` the same for every member of
    ``family``, the rest the member's own."""
    base = 100_000 * (family + 1)
    head = [base + i for i in range(shared * CHUNK)]
    tail = [base + 50_000 + 997 * member + i for i in range((chunks - shared) * CHUNK)]
    return head + tail


@attrs.define(eq=False)
class Node:
    """One node of the fleet: its server process, its engines, its own directories."""

    name: str
    directory: Path
    server: ServerProcess
    env: dict[str, str]
    workers: list[Worker] = attrs.field(factory=list)
    schedulers: list[SchedulerAdapter] = attrs.field(factory=list)

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def worker(self, model: str = "m") -> Worker:
        """An engine worker process on this node (its environment: this node's key dir)."""
        worker = Worker(self.endpoint, model, 1, 0, "flash_attn", (), env=self.env)
        self.workers.append(worker)
        worker.wait_registered()
        return worker

    def scheduler(self, model: str = "m", timeout: float = 5.0) -> SchedulerAdapter:
        adapter = SchedulerAdapter(self.endpoint, model, 1, 0, BLOCK, timeout=timeout)
        self.schedulers.append(adapter)
        wait_for(lambda: adapter.client.server_info is not None, what="the scheduler to connect")
        return adapter

    def kill(self) -> None:
        """SIGKILL the server: no drain, no cleanup (its engines stay)."""
        self.server.stop(signal.SIGKILL)

    def close(self) -> None:
        for adapter in self.schedulers:
            adapter.close()
        for worker in self.workers:
            worker.close()
        self.server.stop(signal.SIGTERM)


def _node(root: Path, index: int, l2: str, extra: Sequence[str]) -> Node:
    directory = root / f"n{index}"
    for sub in ("shm", "keys", "run"):
        (directory / sub).mkdir(parents=True)
    ensure_default_keys(directory / "keys")  # (as a node's first start would)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "KVTRIO_KEY_DIR": str(directory / "keys"),
        "KVTRIO_DRAIN_TIMEOUT": "1",
    }
    args = [*SERVER_ARGS, "--shm-dir", str(directory / "shm"), "--l2", l2, *extra]
    server = ServerProcess(
        f"ipc://{directory}/run/s.sock", args, env, log_path=directory / "server.log"
    )
    return Node(f"n{index}", directory, server, env)


@contextmanager
def fleet(count: int, l2: str, *extra: str) -> Iterator[list[Node]]:
    """``count`` nodes over the L2 spec ``l2`` (the same store), started one after the other;
    stopped and their directories removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="kvf-", dir="/tmp"))  # (ipc paths stay short)
    nodes: list[Node] = []
    try:
        for index in range(count):
            node = _node(root, index, l2, extra)
            nodes.append(node)
            node.server.start(timeout=60)
        yield nodes
    finally:
        for node in nodes:
            node.close()
        shutil.rmtree(root, ignore_errors=True)


def l2_counter(node: Node, name: str) -> float:
    """The node's first L2 backend's counter ``name`` (0 if absent)."""
    backends = stats(node.server).l2
    return float(backends[0].counters.get(name, 0)) if backends else 0.0


def put(worker: Worker, request: str, tokens: list[int], blocks: list[int]) -> None:
    """Compute ``tokens``' KV into ``blocks`` and store it (returns once the store finished)."""
    worker("compute", tokens=tokens, blocks=blocks)
    worker.store(request, tokens, blocks)


@attrs.frozen
class Fetched:
    """What one lookup and retrieve of a prompt through a node gave."""

    hit_tokens: int
    failed: tuple[int, ...]
    """Blocks whose load failed (the engine recomputes them)."""
    wrong: tuple[int, ...]
    """Blocks that were not reported failed and yet do not hold the prompt's KV: must be ()."""


def fetch(
    worker: Worker,
    scheduler: SchedulerAdapter,
    request: str,
    tokens: list[int],
    blocks: list[int],
    **lookup_kw: Any,
) -> Fetched:
    """Look ``tokens`` up, retrieve the hit into ``blocks`` (scrambled first, so a load that
    wrote nothing shows) and check every block that was not reported failed against the
    prompt's own KV; end the request."""
    hit = lookup(scheduler, request, tokens, **lookup_kw)
    failed: list[int] = []
    wrong: list[int] = []
    if hit:
        used = blocks[: hit // BLOCK]
        worker("scramble", blocks=used)
        failed = worker.retrieve(request, tokens, used, end=hit)
        checked = [b for b in used if b not in failed]
        indices = [i for i, b in enumerate(used) if b not in failed]
        wrong = worker("check", tokens=tokens, blocks=checked, indices=indices)["wrong"]
    scheduler.end_session(request)
    return Fetched(hit, tuple(failed), tuple(wrong))


def diagnosis(nodes: Sequence[Node], cluster: Any, spec: str, tokens: list[int]) -> str:
    """What to look at when a fleet does not share: each node's L2 health and counters, its
    cache counters and warnings, and where ``tokens``' chunks are in the cluster (which node
    answers EXISTS for each, and what). For an assertion's message."""
    from kvtrio.storage import ModelProfile, namespace, token_chunk_hashes

    from .e2e import cache

    lines = []
    for node in nodes:
        lines.append(f"{node.name}: {cache(node.server)}")
        for backend in stats(node.server).l2:
            lines.append(f"  {backend.name} healthy={backend.healthy} {backend.counters}")
        log = node.server.log().splitlines()
        lines += [f"  {line}" for line in log if "WARNING" in line or "ERROR" in line][-6:]
    profile = ModelProfile(HASH_SCHEME_TOKENS, 0, 4, 2, 64, "float16", False)
    space = namespace("m", "", profile, 1, 0)
    prefix = spec.split("prefix=")[1].split(",")[0]
    for chunk_hash in token_chunk_hashes(tokens, CHUNK):
        name = prefix + (space + chunk_hash).hex()
        answers = []
        for redis in cluster.nodes:
            if redis.running:
                try:
                    answers.append(f"{redis.port}:{redis.command('EXISTS', name)}")
                except Exception as exc:  # (MOVED from the nodes that do not own it)
                    answers.append(f"{redis.port}:{str(exc)[:40]}")
        lines.append(f"chunk {chunk_hash.hex()[:8]}: {' '.join(answers)}")
    return "\n".join(lines)
