"""Prometheus metrics of one server (``docs/metrics.md`` lists every name and label).

Three kinds of instruments, to keep the request path cheap:

* **tallied per request**: request counts and latencies by operation go into plain dicts and
  lists of the trio thread (a dict update and a ``bisect``, 0.2 µs, against 1.9 µs for a
  prometheus-client counter and histogram, whose every step takes a mutex), turned into metric
  families when scraped;
* **observed per event**: L2 calls by backend and operation, prometheus-client counters and
  histograms (an L2 call costs far more than the observation);
* **read at scrape time**: everything the server already counts for ``stats`` (sessions, hits and
  misses, L1 levels, pins, leases, write-behind, per-backend counters) is turned into metric
  families from one :class:`~kvtrio.protocol.StatsReply` snapshot, so the hot path pays nothing
  for them.

The snapshot is taken in the trio thread (server state is not thread-safe); rendering the text
format runs in a worker thread.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..errors import ErrorCode
from ..protocol import OPERATIONS, StatsReply

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

REQUEST_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
L2_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_UNKNOWN_OP = "unknown"
"""Label of requests whose operation this server does not know (client-chosen names must not
create label values without bound)."""


class ServerMetrics:
    """The metrics of one server. Made first: the server's state takes
    :meth:`observe_request` and its L2 tier :meth:`observe_l2` at their construction, and a
    scrape passes :meth:`render` the state's ``stats`` snapshot."""

    def __init__(self, events: Callable[[], Mapping[str, int]] | None = None) -> None:
        """``events``: the KV event publisher's counters (``--events``), if it runs."""
        self._render = trio.CapacityLimiter(1)
        """Rendering the text format (a worker thread) runs one scrape at a time."""
        self._request_counts: dict[tuple[str, ErrorCode | None], int] = {}
        """Requests answered, by (operation label, error code or None)."""
        self._latency: dict[str, list[float]] = {}
        """Per operation label: the count of each bucket (the last one +Inf), then the sum."""
        self.l2_ops = Counter(
            "kvtrio_l2_operations",
            "Calls into L2 backends, by backend, operation and outcome (ok or error).",
            ["backend", "op", "outcome"],
            registry=None,
        )
        self.l2_latency = Histogram(
            "kvtrio_l2_operation_duration_seconds",
            "Duration of calls into L2 backends, by backend and operation.",
            ["backend", "op"],
            buckets=L2_BUCKETS,
            registry=None,
        )
        self._known_ops = frozenset(OPERATIONS)
        self.events = events

    # ----------------------------------------------------------------- hot path

    def observe_request(self, op: str, code: ErrorCode | None, seconds: float) -> None:
        """Count one answered request and its latency (in the trio thread)."""
        label = op if op in self._known_ops else _UNKNOWN_OP  # client-chosen: bounded labels
        key = (label, code)
        counts = self._request_counts
        counts[key] = counts.get(key, 0) + 1
        latency = self._latency.get(label)
        if latency is None:
            latency = self._latency[label] = [0.0] * (len(REQUEST_BUCKETS) + 2)
        latency[bisect.bisect_left(REQUEST_BUCKETS, seconds)] += 1  # (le: bounds included)
        latency[-1] += seconds

    def request_families(self) -> Iterator[Metric]:
        """The request counter and latency histogram, from the tallies (call in the trio
        thread)."""
        requests = CounterMetricFamily(
            "kvtrio_requests",
            "Requests answered, by operation and outcome (ok or the error code).",
            labels=["op", "outcome"],
        )
        for (label, code), count in sorted(self._request_counts.items(), key=_by_labels):
            requests.add_metric([label, "ok" if code is None else code.value], count)
        yield requests
        latency = HistogramMetricFamily(
            "kvtrio_request_duration_seconds",
            "Time from reading a request to sending its reply, by operation.",
            labels=["op"],
        )
        bounds = [*map(floatToGoString, REQUEST_BUCKETS), "+Inf"]
        for label, tally in sorted(self._latency.items()):
            cumulative = list(itertools.accumulate(tally[:-1]))
            latency.add_metric([label], list(zip(bounds, cumulative, strict=True)), tally[-1])
        yield latency

    def observe_l2(self, backend: str, op: str, seconds: float, ok: bool) -> None:
        self.l2_ops.labels(backend, op, "ok" if ok else "error").inc()
        self.l2_latency.labels(backend, op).observe(seconds)

    # ----------------------------------------------------------------- scraping

    async def render(self, stats: StatsReply) -> bytes:
        """The text exposition format of every metric: ``stats`` (the server's ``stats``
        snapshot, taken by the caller in the trio thread) and the tallies, rendered in a worker
        thread.

        Cancellation: the rendering thread finishes; its result is abandoned.
        """
        families = [*families_from_stats(stats), *self.request_families()]
        if self.events is not None:
            families += _event_families(self.events())
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(families))
        for metric in (self.l2_ops, self.l2_latency):
            registry.register(metric)
        return await trio.to_thread.run_sync(
            generate_latest, registry, limiter=self._render, abandon_on_cancel=True
        )


_EVENT_COUNTERS = {
    "published": "KV events published (each BlockStored / BlockRemoved / AllBlocksCleared).",
    "batches": "KV event batches published (one per tenant topic every events_interval).",
    "dropped": "KV events dropped because the publisher's queue was full.",
    "replays": "Replay requests answered.",
    "refused_subscriptions": "Subscriptions to a topic the subscriber's key may not see.",
}


def _event_families(counters: Mapping[str, int]) -> list[Metric]:
    families = [
        _counter(f"kvtrio_events_{name}", doc, counters.get(name, 0))
        for name, doc in _EVENT_COUNTERS.items()
    ]
    families.append(
        _gauge("kvtrio_events_queued", "KV events waiting to be sent.", counters.get("queued", 0))
    )
    return families


def _by_labels(item: tuple[tuple[str, ErrorCode | None], int]) -> tuple[str, str]:
    (label, code), _ = item
    return label, "" if code is None else code.value


class _Snapshot(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families

    def describe(self) -> Iterable[Metric]:
        return []


def _gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=list(labels or ()))
    family.add_metric(list((labels or {}).values()), value)
    return family


def _counter(name: str, doc: str, value: float) -> Metric:
    return CounterMetricFamily(name, doc, value=value)


def families_from_stats(stats: StatsReply) -> Iterator[Metric]:
    """Metric families of everything a ``stats`` reply holds (see ``docs/metrics.md``)."""
    info = GaugeMetricFamily(
        "kvtrio_info", "Always 1; labels name the server.", labels=["version", "instance"]
    )
    info.add_metric([stats.server_version, stats.instance_id], 1)
    yield info
    yield _gauge("kvtrio_uptime_seconds", "Seconds since the server started.", stats.uptime_seconds)
    phase = GaugeMetricFamily(
        "kvtrio_phase", "1 for the phase the server is in, 0 for the others.", labels=["phase"]
    )
    for name in ("starting", "serving", "draining"):
        phase.add_metric([name], 1 if stats.phase == name else 0)
    yield phase

    c = stats.counters
    errors = CounterMetricFamily(
        "kvtrio_errors", "Error replies sent, by error code.", labels=["code"]
    )
    for code, count in sorted(c.errors_by_code.items()):
        errors.add_metric([code], count)
    yield errors
    yield _counter(
        "kvtrio_frames_dropped",
        "Messages dropped because no request id could be read from them.",
        c.frames_dropped,
    )
    yield _counter(
        "kvtrio_replies_undeliverable",
        "Replies dropped because the client had gone or stopped reading.",
        c.replies_undeliverable,
    )
    yield _gauge("kvtrio_sessions", "Live client sessions.", len(stats.sessions))
    yield _counter("kvtrio_sessions_started", "Client sessions started.", c.sessions_started)
    yield _counter(
        "kvtrio_sessions_ended", "Client sessions ended, for any reason.", c.sessions_ended
    )
    yield _counter(
        "kvtrio_sessions_expired",
        "Client sessions ended because the client was silent past the heartbeat timeout.",
        c.sessions_expired,
    )
    yield from _cache_families(stats)
    yield from _l2_families(stats)


def _cache_families(stats: StatsReply) -> Iterator[Metric]:
    cache = stats.cache
    if cache is None:
        return
    chunk = int(stats.config.get("chunk_size", 0))
    yield _gauge("kvtrio_registrations", "Registered engine workers.", cache.registrations)
    yield _counter("kvtrio_lookups", "Lookups answered.", cache.lookups)
    l1_hits = cache.lookup_hit_chunks - cache.lookup_l2_chunks
    hit_chunks = CounterMetricFamily(
        "kvtrio_lookup_hit_chunks",
        "Chunks lookups found, by the tier they were found in (l2 hits are loaded into L1).",
        labels=["tier"],
    )
    hit_tokens = CounterMetricFamily(
        "kvtrio_lookup_hit_tokens",
        "Tokens of the chunks lookups found (chunks × chunk size), by tier.",
        labels=["tier"],
    )
    for tier, count in (("l1", l1_hits), ("l2", cache.lookup_l2_chunks)):
        hit_chunks.add_metric([tier], count)
        hit_tokens.add_metric([tier], count * chunk)
    yield hit_chunks
    yield hit_tokens
    yield _counter(
        "kvtrio_lookup_miss_chunks",
        "Full chunks of looked-up prompts that were found in no tier.",
        cache.lookup_miss_chunks,
    )
    yield _counter(
        "kvtrio_lookup_miss_tokens",
        "Tokens of those chunks (chunks × chunk size).",
        cache.lookup_miss_chunks * chunk,
    )
    yield _counter(
        "kvtrio_lookup_timeouts",
        "Lookups whose L2 part ran out of time (they answered with what they had).",
        cache.lookup_timeouts,
    )
    yield _gauge("kvtrio_l1_capacity_bytes", "Size of the L1 arena.", cache.l1_capacity_bytes)
    yield _gauge("kvtrio_l1_used_bytes", "Bytes of the L1 arena in use.", cache.l1_used_bytes)
    entries = GaugeMetricFamily("kvtrio_l1_entries", "Chunks in L1, by state.", labels=["state"])
    entries.add_metric(["ready"], cache.l1_ready)
    entries.add_metric(["writing"], cache.l1_writing)
    yield entries
    yield _counter("kvtrio_l1_evictions", "Chunks evicted from L1.", cache.l1_evictions)
    yield _counter(
        "kvtrio_l1_store_failures",
        "Chunks a store could not place in L1 (no room even after eviction).",
        cache.store_failures,
    )
    yield _gauge("kvtrio_pins", "Pins held on L1 chunks right now.", cache.l1_pins)
    yield _gauge(
        "kvtrio_pinned_chunks", "L1 chunks with at least one pin.", cache.l1_pinned_entries
    )
    yield _gauge(
        "kvtrio_leases",
        "Live leases (lookup pins, read pins, write reservations).",
        cache.leases,
    )
    yield _counter(
        "kvtrio_leases_expired",
        "Leases that expired because their client neither released nor ended them.",
        cache.leases_expired,
    )
    yield _gauge(
        "kvtrio_requests_tracked",
        "Engine requests whose prompt hashes the server remembers.",
        cache.requests,
    )
    yield _gauge("kvtrio_l2_loads_pending", "L2→L1 loads under way.", cache.loads_pending)
    yield _counter("kvtrio_l2_loads_failed", "L2→L1 loads that failed.", cache.loads_failed)
    yield _counter(
        "kvtrio_l2_corrupt",
        "L2 objects that failed their integrity check (deleted, counted as misses).",
        cache.l2_corrupt,
    )
    yield _gauge(
        "kvtrio_write_behind_queue_depth",
        "Committed chunks waiting to be written to L2.",
        cache.write_behind_queued,
    )
    yield _counter(
        "kvtrio_write_behind_skipped",
        "Chunks not written to L2 because the write-behind queue was full.",
        cache.write_behind_skipped,
    )
    admission = CounterMetricFamily(
        "kvtrio_l2_admission_chunks",
        "Committed chunks by L2 admission's decision: admitted at commit, refused (seen once), "
        "admitted_later (refused, then used again while in L1).",
        labels=["decision"],
    )
    for decision, count in (
        ("admitted", cache.l2_admitted),
        ("refused", cache.l2_refused),
        ("admitted_later", cache.l2_admitted_later),
    ):
        admission.add_metric([decision], count)
    yield admission


_BACKEND_USAGE = (
    ("bytes", "kvtrio_l2_used_bytes", "Bytes an L2 backend holds, as it reports them."),
    ("capacity_bytes", "kvtrio_l2_capacity_bytes", "An L2 backend's capacity, if it has one."),
    ("objects", "kvtrio_l2_objects", "Objects an L2 backend holds, as it reports them."),
)
_BACKEND_COUNTERS = (
    ("errors", "kvtrio_l2_errors", "Failed calls into an L2 backend (each starts a backoff)."),
    ("stores", "kvtrio_l2_stores", "Chunks written to an L2 backend."),
    ("stores_refused", "kvtrio_l2_stores_refused", "Chunks an L2 backend refused to store."),
    (
        "stores_skipped",
        "kvtrio_l2_stores_skipped",
        "Chunks not written to an L2 backend because it was backing off after failures.",
    ),
    ("loads", "kvtrio_l2_loads", "Chunks loaded from an L2 backend."),
    ("load_misses", "kvtrio_l2_load_misses", "Loads that found no usable object."),
)


def _l2_families(stats: StatsReply) -> Iterator[Metric]:
    healthy = GaugeMetricFamily(
        "kvtrio_l2_healthy",
        "1 while an L2 backend works, 0 while its lookups or stores fail (until one succeeds "
        "again; the reason is in /status and /healthz), NaN until anything answered.",
        labels=["backend"],
    )
    moved = CounterMetricFamily(
        "kvtrio_l2_bytes",
        "Chunk bytes written to (stored) and read from (loaded) an L2 backend.",
        labels=["backend", "direction"],
    )
    usage = {
        key: GaugeMetricFamily(name, doc, labels=["backend"]) for key, name, doc in _BACKEND_USAGE
    }
    counters = {
        key: CounterMetricFamily(name, doc, labels=["backend"])
        for key, name, doc in _BACKEND_COUNTERS
    }
    for backend in stats.l2:
        label = [backend.name]
        healthy.add_metric(label, math.nan if backend.healthy is None else int(backend.healthy))
        moved.add_metric([backend.name, "stored"], backend.counters.get("store_bytes", 0))
        moved.add_metric([backend.name, "loaded"], backend.counters.get("load_bytes", 0))
        for key, family in usage.items():
            if key in backend.counters:
                family.add_metric(label, backend.counters[key])
        for key, counter in counters.items():
            counter.add_metric(label, backend.counters.get(key, 0))
    yield healthy
    yield moved
    yield from usage.values()
    yield from counters.values()
