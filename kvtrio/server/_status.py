"""The status document: what ``GET /status`` answers and ``kvtrio status`` prints.

Built from a ``stats`` reply alone, so that the HTTP endpoint and the ZeroMQ ``stats`` operation
(for servers that run without HTTP) show exactly the same thing.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import attrs

from ..config import ServerConfig
from ..errors import ConfigError
from ..options import format_size, parse_size
from ..protocol import StatsReply
from ..shm import default_shm_dir

__all__ = ["backend_health", "status_document", "status_summary", "storage_summary"]

_WHERE_KEYS = ("path", "url", "endpoint", "bucket")
"""Backend options that say where the data goes; never the others (they may be credentials)."""


def storage_summary(config: ServerConfig, l1_sizing: str = "") -> dict[str, Any]:
    """Where a server keeps data and how much it may take: L1's size, directory and why it has
    that size (``l1_sizing``, if known), each L2 backend's location (its options, defaults
    filled in, passwords in URLs masked) and capacity. ``l1_size`` None (not sized yet) shows
    as ``auto``.

    Never raises for an unknown backend (it is listed by name alone).
    """
    from ..l2 import load_backend_class

    backends = []
    for spec in config.l2:
        values: dict[str, Any] = {}
        try:
            options = load_backend_class(spec.name).Options
            values = {
                f.name: f.default for f in attrs.fields(options) if f.default is not attrs.NOTHING
            }
        except ConfigError:
            pass
        values.update(spec.options)
        entry: dict[str, Any] = {"name": spec.name}
        for key in _WHERE_KEYS:
            if values.get(key) not in (None, ""):
                entry[key] = _masked(os.path.expanduser(str(values[key])))
        if values.get("capacity") not in (None, ""):
            with contextlib.suppress(ValueError):
                entry["capacity_bytes"] = parse_size(values["capacity"])
        backends.append(entry)
    l1: dict[str, Any] = {"bytes": config.l1_size, "directory": config.shm_dir or default_shm_dir()}
    if l1_sizing:
        l1["sizing"] = l1_sizing
    return {"l1": l1, "l2": backends}


_SECRET_WORDS = ("password", "passwd", "secret", "token", "credential", "key")
"""Query options whose name holds one of these are masked (``?password=``, which redis-py
reads, ``?aws_secret_access_key=``...)."""


def _masked(value: str) -> str:
    """``redis://user:secret@host`` → ``redis://user:***@host``, and the value of a query
    option named like a secret (``?password=secret`` → ``?password=***``; was shown as given,
    to any key's ``stats``); anything else unchanged."""
    if "://" not in value:
        return value
    parts = urlsplit(value)
    if parts.password is not None:
        user = f"{parts.username}:***" if parts.username else ":***"
        host = parts.netloc.rpartition("@")[2]
        parts = parts._replace(netloc=f"{user}@{host}")
    if parts.query:
        options = parse_qsl(parts.query, keep_blank_values=True)
        parts = parts._replace(
            query=urlencode(
                [
                    (name, "***" if any(w in name.lower() for w in _SECRET_WORDS) else text)
                    for name, text in options
                ],
                safe="*",
            )
        )
    return urlunsplit(parts)


def describe_storage(storage: dict[str, Any]) -> str:
    """One line for the start-up log: ``L1 4GiB (default) of shared memory in /dev/shm,
    committed now; L2 disk /home/me/.cache/kvtrio/l2 (up to 32GiB)``."""
    l1 = storage["l1"]
    text = f"L1 {_l1_size(l1)} of shared memory in {l1['directory']}, committed now"
    tiers = [_describe_backend(entry) for entry in storage["l2"]]
    return f"{text}; L2 {', then '.join(tiers) if tiers else 'none'}"


def _l1_size(l1: dict[str, Any]) -> str:
    """``4GiB (default)``, ``1.5GiB (50% of /dev/shm's 3GiB free)``, ``auto``."""
    size = "auto" if l1.get("bytes") is None else format_size(l1["bytes"])
    return f"{size} ({l1['sizing']})" if l1.get("sizing") else size


def _describe_backend(entry: dict[str, Any]) -> str:
    where = " ".join(str(entry[key]) for key in _WHERE_KEYS if key in entry)
    text = f"{entry['name']} {where}".strip()
    if "capacity_bytes" in entry:
        text += f" (up to {format_size(entry['capacity_bytes'])})"
    return text


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
            "admitted": cache.l2_admitted,
            "refused": cache.l2_refused,
            "admitted_later": cache.l2_admitted_later,
        }
    document["l2"] = [
        {
            "name": backend.name,
            "healthy": backend.healthy,
            **({"problem": backend.problem} if backend.problem else {}),
            **backend.counters,
        }
        for backend in stats.l2
    ]
    storage = stats.config.get("storage")
    if isinstance(storage, dict):  # servers before issue 15 do not send it
        for entry, where in zip(document["l2"], storage.get("l2", ()), strict=False):
            entry.update({k: v for k, v in where.items() if k != "name"})
    return document


def status_summary(document: dict[str, Any]) -> str:
    """The status document as a short text, in sections like ``redis-cli info``'s."""
    config = document.get("config", {})
    lines = [
        "# Server",
        f"version: {document.get('version')}",
        f"instance: {document.get('instance_id')}",
        f"phase: {document.get('phase')}",
        f"uptime: {_duration(document.get('uptime_seconds', 0.0))}",
        f"endpoint: {config.get('endpoint')}",
        f"chunk size: {config.get('chunk_size')} tokens",
    ]
    requests, sessions = document.get("requests", {}), document.get("sessions", {})
    lines += [
        "",
        "# Clients",
        f"sessions: {sessions.get('live', 0)} live ({sessions.get('started', 0)} started, "
        f"{sessions.get('ended', 0)} ended, {sessions.get('expired', 0)} expired)",
        f"requests: {requests.get('total', 0)} ({requests.get('errors', 0)} errors)",
    ]
    if "l1" in document:
        l1, lookups = document["l1"], document.get("lookups", {})
        storage = config.get("storage", {}).get("l1", {})
        where = f" in {storage['directory']}" if "directory" in storage else ""
        size = _l1_size({"bytes": l1["capacity_bytes"], **storage})
        ratio = lookups.get("hit_ratio")
        lines += [
            "",
            "# L1",
            f"size: {size}{where}",
            f"used: {format_size(l1['used_bytes'])} of {format_size(l1['capacity_bytes'])} "
            f"({l1['chunks']} chunks, {l1['evictions']} evicted)",
            f"lookups: {lookups.get('lookups', 0)}, hit ratio "
            f"{'n/a' if ratio is None else f'{ratio:.1%}'} ({lookups.get('hit_chunks_l1', 0)} "
            f"chunks from L1, {lookups.get('hit_chunks_l2', 0)} from L2, "
            f"{lookups.get('miss_chunks', 0)} missed)",
        ]
    lines += ["", "# L2"]
    if not document.get("l2"):
        lines.append("none")
    for backend in document.get("l2", []):
        lines.append(f"{_describe_backend(backend)}: {backend_health(backend)}")
    return "\n".join(lines)


def backend_health(backend: dict[str, Any]) -> str:
    """``healthy``, ``unknown`` (nothing answered yet) or ``UNHEALTHY (why)`` for an entry of
    the status document's ``l2``."""
    healthy = backend.get("healthy")
    if healthy is False:
        problem = backend.get("problem")
        return f"UNHEALTHY ({problem})" if problem else "UNHEALTHY"
    return "healthy" if healthy else "unknown"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
