"""What a bench run measured, and the figures derived from it."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

__all__ = ["BenchResult", "RequestRecord", "percentile"]


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


@attrs.define
class RequestRecord:
    index: int
    done_at: float
    """Seconds from the start of the run to the end of the request."""
    tokens: int
    chunks: int
    hit_tokens: int
    hit_chunks: int


@attrs.define
class BenchResult:
    """Counters and samples of one run; :meth:`summary` derives the reported figures."""

    mode: str
    workload: str
    engine: str
    endpoint: str
    chunk_size: int
    world_size: int
    requests: list[RequestRecord] = attrs.field(factory=list)
    lookup_seconds: list[float] = attrs.field(factory=list)
    retrieve_seconds: list[float] = attrs.field(factory=list)
    """Per worker and retrieve: submit → done, as the adapter reports it."""
    store_seconds: list[float] = attrs.field(factory=list)
    bytes_retrieved: int = 0
    bytes_stored: int = 0
    retrieved_blocks: int = 0
    failed_blocks: int = 0
    """Blocks a retrieve reported failed (the engine recomputes them): not a checksum failure."""
    checksum_failures: int = 0
    """Blocks a retrieve reported loaded whose bytes differ from what was stored."""
    lookup_failures: int = 0
    truncated: int = 0
    """Requests longer than the engine's cache (only their first blocks were used)."""
    wall_seconds: float = 0.0
    l1_hit_chunks: int | None = None
    """From the server's counters (its lookups over the run; other clients' too, if any)."""
    l2_hit_chunks: int | None = None
    server_miss_chunks: int | None = None
    """Chunks the server's lookups over the run found nowhere. The server counts every chunk
    hash a lookup carries: each prompt's full chunks *and* its partial last chunk (its whole
    blocks after the full chunks; the server cannot tell it apart), so its hit ratio (what
    ``kvtrio status`` shows, since the server started) is lower than :meth:`summary`'s
    ``hit_ratio_chunks``, of full chunks only."""
    server: dict[str, int] = attrs.field(factory=dict)
    """Changes of the server's counters over the run (evictions, skipped L2 writes, ...)."""
    settings: str = ""
    """The server's settings as a title line: chunk size, L1, L2."""
    speed: float = 0.0
    """How many times faster than its timestamps a trace was replayed (0: as fast as possible)."""
    planned: int = 0
    """Requests the workload has; more than ``len(requests)`` when the run was interrupted."""
    interrupted: bool = False

    @property
    def prompt_tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def hit_tokens(self) -> int:
        return sum(r.hit_tokens for r in self.requests)

    @property
    def chunks(self) -> int:
        return sum(r.chunks for r in self.requests)

    @property
    def hit_chunks(self) -> int:
        return sum(r.hit_chunks for r in self.requests)

    def summary(self) -> dict[str, Any]:
        """Every reported figure, JSON-ready (latencies in seconds)."""
        moved = self.bytes_retrieved + self.bytes_stored
        wall = self.wall_seconds or float("nan")
        return {
            "mode": self.mode,
            "workload": self.workload,
            "engine": self.engine,
            "endpoint": self.endpoint,
            "chunk_size": self.chunk_size,
            "world_size": self.world_size,
            "requests": len(self.requests),
            "wall_seconds": self.wall_seconds,
            "requests_per_second": len(self.requests) / wall,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_ratio_tokens": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0,
            "chunks": self.chunks,
            "hit_chunks": self.hit_chunks,
            "hit_ratio_chunks": self.hit_chunks / self.chunks if self.chunks else 0,
            "l1_hit_chunks": self.l1_hit_chunks,
            "l2_hit_chunks": self.l2_hit_chunks,
            "server_miss_chunks": self.server_miss_chunks,
            "latency_seconds": {
                name: {
                    "count": len(values),
                    "p50": percentile(values, 50),
                    "p99": percentile(values, 99),
                }
                for name, values in (
                    ("lookup", self.lookup_seconds),
                    ("retrieve", self.retrieve_seconds),
                    ("store", self.store_seconds),
                )
            },
            "bytes_retrieved": self.bytes_retrieved,
            "bytes_stored": self.bytes_stored,
            "gb_per_second": moved / wall / 1e9,
            "retrieved_blocks": self.retrieved_blocks,
            "failed_blocks": self.failed_blocks,
            "checksum_failures": self.checksum_failures,
            "lookup_failures": self.lookup_failures,
            "truncated_requests": self.truncated,
            "server": dict(self.server),
        }

    def to_json(self) -> dict[str, Any]:
        """The summary, the latency samples and one record per request."""
        return {
            **self.summary(),
            "samples_seconds": {
                "lookup": self.lookup_seconds,
                "retrieve": self.retrieve_seconds,
                "store": self.store_seconds,
            },
            "per_request": [attrs.asdict(r) for r in self.requests],
        }
