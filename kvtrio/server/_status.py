"""The status document: what ``GET /status`` answers and ``kvtrio status`` prints.

Built from a ``stats`` reply alone, so that the HTTP endpoint and the ZeroMQ ``stats`` operation
(for servers that run without HTTP) show exactly the same thing.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..protocol import StatsReply

__all__ = ["status_document"]


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def status_document(stats: StatsReply) -> dict[str, Any]:
    """A JSON-ready summary of a server: version, uptime, phase, settings, sessions, L1, L2."""
    counters = stats.counters
    document: dict[str, Any] = {
        "version": stats.server_version,
        "instance_id": stats.instance_id,
        "phase": stats.phase,
        "uptime_seconds": round(stats.uptime_seconds, 3),
        "config": dict(stats.config),
        "requests": {
            "total": counters.requests,
            "errors": counters.errors,
            "errors_by_code": dict(counters.errors_by_code),
            "frames_dropped": counters.frames_dropped,
            "replies_undeliverable": counters.replies_undeliverable,
        },
        "sessions": {
            "live": len(stats.sessions),
            "started": counters.sessions_started,
            "ended": counters.sessions_ended,
            "expired": counters.sessions_expired,
            "clients": [attrs.asdict(session) for session in stats.sessions],
        },
    }
    cache = stats.cache
    if cache is not None:
        chunk = int(stats.config.get("chunk_size", 0))
        found = cache.lookup_hit_chunks
        document["l1"] = {
            "capacity_bytes": cache.l1_capacity_bytes,
            "used_bytes": cache.l1_used_bytes,
            "used_ratio": _ratio(cache.l1_used_bytes, cache.l1_capacity_bytes),
            "chunks": cache.l1_entries,
            "chunks_writing": cache.l1_writing,
            "pinned_chunks": cache.l1_pinned_entries,
            "pins": cache.l1_pins,
            "evictions": cache.l1_evictions,
            "store_failures": cache.store_failures,
        }
        document["lookups"] = {
            "lookups": cache.lookups,
            "hit_chunks_l1": found - cache.lookup_l2_chunks,
            "hit_chunks_l2": cache.lookup_l2_chunks,
            "miss_chunks": cache.lookup_miss_chunks,
            "hit_tokens": found * chunk,
            "miss_tokens": cache.lookup_miss_chunks * chunk,
            "hit_ratio": _ratio(found, found + cache.lookup_miss_chunks),
            "timeouts": cache.lookup_timeouts,
        }
        document["leases"] = {"live": cache.leases, "expired": cache.leases_expired}
        document["registrations"] = cache.registrations
        document["write_behind"] = {
            "queued": cache.write_behind_queued,
            "skipped": cache.write_behind_skipped,
        }
    document["l2"] = [
        {"name": backend.name, "healthy": backend.healthy, **backend.counters}
        for backend in stats.l2
    ]
    return document
