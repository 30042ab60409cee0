"""A fleet on one cache (issue 26): the Mooncake trace spread over 1, 2 and 3 kvtrio servers that
share a Valkey Cluster (3 primaries + 3 replicas, started here), against one server with the same
total L1.

    python bench/fleet.py [--trace FILE] [--limit 300] [--l1-total 48MiB] [--probes 20]

Every server is a ``kvtrio serve`` process with its own endpoint, shared-memory and key
directories; each gets the same total L1 divided by the fleet's size (1 × 48 MiB, 2 × 24 MiB,
3 × 16 MiB), and the cluster is emptied before each configuration. Request ``i`` of the trace
goes to server ``i mod N``, one request at a time in the trace's order (so a fleet and one
server see the same sequence): a lookup (timed), a retrieve of the hit (L2 hits are loaded into
that server's L1), a store and commit of the rest (the slots' bytes are not written: this
measures the cache, not the copies). Hash mode, 256-token chunks of
8 KiB (1 layer, 1 head of 8, float16: small, so that the trace's ~15k distinct chunks fit the
machine's memory twice over, primaries and replicas; the store's costs per chunk scale with it).

It prints, per configuration: the token hit ratio (and its difference from one server's), L2
hit chunks per node, cross-node hit chunks (hits of chunks this node never stored: they came
through the shared store), lookup p50/p99, the kvtrio servers' CPU, and the Valkey cluster's own
CPU, network bytes and commands per stored chunk. Then the visibility delay: a prompt stored
through A, polled through B until it is a full hit (``--probes`` times), with write-behind and
with ``--l2-write-through``. Medians and ratios; the baseline (one server) runs in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvtrio.benchmark._options import BenchOptions
from kvtrio.benchmark._workload import TraceWorkload
from kvtrio.client import Client
from kvtrio.launch import ServerProcess
from kvtrio.options import format_size, parse_size
from kvtrio.protocol import (
    Commit,
    EndSession,
    GetStats,
    LayoutSpec,
    Lookup,
    LookupReply,
    Register,
    Release,
    Retrieve,
    RetrieveReply,
    StatsReply,
    Store,
    StoreReply,
    block_chunk_hashes,
    block_hash_scheme,
)
from kvtrio.transport import ensure_default_keys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_support: test servers

from tests._support.redis_servers import LocalRedisCluster, redis_cluster

TRACE = Path(__file__).resolve().parents[1] / "docs" / "sample_trace.jsonl"
"""The repository's small trace (120 requests); docs/fleet.md's figures are of the Mooncake
trace, passed with ``--trace`` (``FAST25-release/traces/synthetic_trace.jsonl`` of
github.com/kvcache-ai/Mooncake, Apache-2.0; not in this repository)."""
CHUNK, BLOCK = 256, 16
LAYOUT = LayoutSpec("flash_attn", 1, 64, BLOCK, 1, 8, "float16")  # 8 KiB per chunk
SCHEME = block_hash_scheme("bench-fleet")
TICK = os.sysconf("SC_CLK_TCK")


class Node:
    """One ``kvtrio serve`` with a worker session (register, store, retrieve) and a scheduler
    session (lookups) of its own."""

    def __init__(self, root: Path, index: int, l2: str, l1: int, extra: Sequence[str]) -> None:
        self.index = index
        directory = root / f"n{index}"
        for sub in ("shm", "keys"):
            (directory / sub).mkdir(parents=True)
        ensure_default_keys(directory / "keys")
        env = {**os.environ, "KVTRIO_KEY_DIR": str(directory / "keys")}
        args = ["--l1-size", f"{l1}B", "--shm-dir", str(directory / "shm"), "--l2", l2]
        self.server = ServerProcess(
            f"ipc://{directory}/s.sock", [*args, *extra], env, log_path=directory / "log"
        ).start(timeout=60)
        self.worker = Client(self.server.endpoint, timeout=30.0)
        self.worker.request(Register("", "m", 1, 0, LAYOUT, SCHEME))
        self.scheduler = Client(self.server.endpoint, timeout=30.0)
        self.stored: set[bytes] = set()
        self.lookup_s: list[float] = []

    def lookup(self, request: str, hashes: Sequence[bytes]) -> int:
        started = time.perf_counter()
        reply = self.scheduler.call(Lookup(request, "m", 1, tuple(hashes)), LookupReply)
        self.lookup_s.append(time.perf_counter() - started)
        return reply.hit_chunks

    def serve(self, request: str, hashes: Sequence[bytes]) -> tuple[int, int]:
        """One request: look up, retrieve the hit, store the rest. (hit chunks, cross-node)."""
        hit = self.lookup(request, hashes)
        if hit:
            reply = self.worker.call(
                Retrieve(request, 0, hit * CHUNK, tuple(hashes[:hit])), RetrieveReply
            )
            read = tuple(hashes[s.chunk] for s in reply.slots if s.status == "read")
            if read:
                self.worker.request(Release(request, read))
        cross = sum(1 for h in hashes[:hit] if h not in self.stored)
        if hit < len(hashes):
            self.store(request, hashes, hit)
        self.scheduler.request(EndSession(request, "m"))
        return hit, cross

    def store(self, request: str, hashes: Sequence[bytes], start: int = 0) -> None:
        rest = tuple(hashes[start:])
        reply = self.worker.call(
            Store(request, start * CHUNK, len(hashes) * CHUNK, rest, parent_hash=b""), StoreReply
        )
        written = tuple(rest[s.chunk - start] for s in reply.slots if s.status == "write")
        self.worker.request(Commit(request, written=written))
        self.stored.update(rest)

    def stats(self) -> StatsReply:
        return self.scheduler.call(GetStats(), StatsReply)

    def cpu_s(self) -> float:
        return _cpu_s(self.server.pid)

    def close(self) -> None:
        self.worker.close()
        self.scheduler.close()
        self.server.stop()


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _valkey(cluster: LocalRedisCluster) -> dict[str, float]:
    """The cluster's own counters, summed over its running nodes: CPU seconds, network bytes
    in and out (replication included), commands processed."""
    total = {"cpu_s": 0.0, "net_in": 0.0, "net_out": 0.0, "commands": 0.0}
    for node in cluster.nodes:
        if not node.running:
            continue
        total["cpu_s"] += _cpu_s(node.pid)
        info = node.command("INFO", "stats").decode()
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        total["net_in"] += float(fields["total_net_input_bytes"])
        total["net_out"] += float(fields["total_net_output_bytes"])
        total["commands"] += float(fields["total_commands_processed"])
    return total


@contextlib.contextmanager
def fleet(count: int, l2: str, l1_total: int, extra: Sequence[str] = ()) -> Iterator[list[Node]]:
    root = Path(tempfile.mkdtemp(prefix="kvfb-", dir="/tmp"))
    nodes: list[Node] = []
    try:
        for index in range(count):
            nodes.append(Node(root, index, l2, l1_total // count, extra))
        yield nodes
    finally:
        for node in nodes:
            node.close()
        shutil.rmtree(root, ignore_errors=True)


def chunk_hashes(workload: TraceWorkload, index: int) -> list[bytes]:
    blocks = workload.prompt(index)["block_hashes"]
    return block_chunk_hashes(blocks, CHUNK // BLOCK)


def replay(
    cluster: LocalRedisCluster, spec: str, count: int, l1_total: int, workload: TraceWorkload,
    extra: Sequence[str] = (),
) -> dict[str, Any]:  # fmt: skip
    """The trace through ``count`` servers; what :func:`main` prints for one row."""
    with fleet(count, spec, l1_total, extra) as nodes:
        cpu_before = [node.cpu_s() for node in nodes]
        store_before = _valkey(cluster)
        started = time.perf_counter()
        prompt_tokens = hit_tokens = cross = 0
        stored_chunks = 0
        for index in range(len(workload.requests)):
            hashes = chunk_hashes(workload, index)
            node = nodes[index % count]
            hit, crossed = node.serve(f"r{index}", hashes)
            prompt_tokens += workload.requests[index].tokens
            hit_tokens += hit * CHUNK
            cross += crossed
            stored_chunks += len(hashes) - hit
        wall = time.perf_counter() - started
        _drain(nodes)
        store_after = _valkey(cluster)
        stats = [node.stats() for node in nodes]
        lookups = sorted(s for node in nodes for s in node.lookup_s)
        return {
            "servers": count,
            "hit_ratio": hit_tokens / prompt_tokens,
            "l2_hits": [s.cache.lookup_l2_chunks if s.cache else 0 for s in stats],
            "cross": cross,
            "p50_ms": 1000 * lookups[len(lookups) // 2],
            "p99_ms": 1000 * lookups[min(len(lookups) - 1, int(len(lookups) * 0.99))],
            "kvtrio_cpu_s": sum(n.cpu_s() - b for n, b in zip(nodes, cpu_before, strict=True)),
            "wall_s": wall,
            "stored_chunks": stored_chunks,
            **{f"store_{k}": store_after[k] - store_before[k] for k in store_after},
        }


def _drain(nodes: Sequence[Node], timeout: float = 60.0) -> None:
    """Wait until every node's write-behind queue is empty (its chunks are in the store)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queued = [n.stats().cache for n in nodes]
        if all(c is None or c.write_behind_queued == 0 for c in queued):
            return
        time.sleep(0.05)


def visibility(
    cluster: LocalRedisCluster, spec: str, probes: int, extra: Sequence[str]
) -> list[float]:
    """Seconds from "store finished" (the commit's reply) through A to a full hit through B,
    for ``probes`` fresh 8-chunk prompts."""
    delays = []
    with fleet(2, spec, 32 << 20, extra) as (a, b):
        for probe in range(probes):
            hashes = [os.urandom(16) for _ in range(8)]
            a.store(f"v{probe}", hashes)
            finished = time.perf_counter()
            deadline = finished + 10
            while b.lookup(f"w{probe}", hashes) < len(hashes):
                b.scheduler.request(EndSession(f"w{probe}", "m"))
                assert time.perf_counter() < deadline, "not visible within 10 s"
            delays.append(time.perf_counter() - finished)
            b.scheduler.request(EndSession(f"w{probe}", "m"))
    return delays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace",
        type=Path,
        default=TRACE,
        help="a Mooncake-format trace [default: docs/sample_trace.jsonl; docs/fleet.md's "
        "figures: Mooncake's FAST25-release/traces/synthetic_trace.jsonl]",
    )
    parser.add_argument("--limit", type=int, default=300, help="first N requests of the trace")
    parser.add_argument("--l1-total", default="48MiB", help="L1 of the whole fleet")
    parser.add_argument("--probes", type=int, default=20, help="visibility probes per setting")
    args = parser.parse_args()
    options = BenchOptions(trace=args.trace, limit=args.limit, block_size=BLOCK).resolved()
    workload = TraceWorkload(options)
    l1_total = parse_size(args.l1_total)

    def spec() -> str:  # (an empty cluster for every configuration)
        cluster.flushall()
        return f"redis:url={cluster.url},cluster=true"

    with redis_cluster(3, replicas=1, timeout=60) as cluster:
        rows = [replay(cluster, spec(), n, l1_total, workload) for n in (1, 2, 3)]
        through = ["--l2-write-through", "2"]
        rows += [replay(cluster, spec(), n, l1_total, workload, through) for n in (2, 3)]
        behind = visibility(cluster, spec(), args.probes, ())
        written = visibility(cluster, spec(), args.probes, through)
    print(
        f"{len(workload.requests)} requests of {args.trace.name}, L1 {format_size(l1_total)} "
        "in total, Valkey Cluster 3 primaries + 3 replicas (one machine, loopback)\n"
    )
    base = rows[0]["hit_ratio"]
    print(
        "| servers | write | token hits | vs 1 server | L2 hit chunks per node | cross-node hit "
        "chunks | lookup p50 / p99 | kvtrio CPU | stored chunks | Valkey CPU (per stored "
        "chunk) | Valkey net in / out per stored chunk | Valkey commands per stored chunk |"
    )
    print("| --- " * 12 + "|")
    for i, row in enumerate(rows):
        mode = "behind" if i < 3 else "through 2 s"
        per = max(row["stored_chunks"], 1)
        print(
            f"| {row['servers']} | {mode} | {100 * row['hit_ratio']:.2f} % | "
            f"{100 * (row['hit_ratio'] - base):+.2f} pt | "
            f"{' / '.join(str(h) for h in row['l2_hits'])} | {row['cross']} | "
            f"{row['p50_ms']:.2f} / {row['p99_ms']:.2f} ms | {row['kvtrio_cpu_s']:.1f} s | "
            f"{row['stored_chunks']} | {row['store_cpu_s']:.1f} s "
            f"({1e6 * row['store_cpu_s'] / per:.0f} µs) | {row['store_net_in'] / per / 1024:.1f} / "
            f"{row['store_net_out'] / per / 1024:.1f} KiB | {row['store_commands'] / per:.1f} |"
        )
    print()
    for name, delays in (("write-behind", behind), ("write-through 2 s", written)):
        ms = sorted(1000 * d for d in delays)
        print(
            f"store finished at A → full hit at B, {name}: median {statistics.median(ms):.1f} ms, "
            f"max {ms[-1]:.1f} ms ({len(ms)} prompts of 8 chunks)"
        )


if __name__ == "__main__":
    main()
