"""The HTTP endpoint of a server in the test's trio loop: /metrics scraped and parsed with
Prometheus' own text parser, /healthz through a drain, /status."""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import attrs
import msgpack
import pytest
import trio
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvtrio.config import BackendSpec, ServerConfig, config_summary
from kvtrio.errors import ConfigError
from kvtrio.l2.memory import MemoryBackend
from kvtrio.protocol import (
    PROTOCOL_VERSION,
    Commit,
    GetStats,
    LayoutSpec,
    Lookup,
    LookupReply,
    StatsReply,
    Store,
    StoreReply,
)
from kvtrio.server import ServerHandle, ServerMetrics, ServerState, open_server, status_document
from kvtrio.server._http import HttpApp
from kvtrio.storage import token_chunk_hashes
from kvtrio.testing import FaultBackend
from kvtrio.transport import open_socket

from .._support.serving import serving
from .._support.waiting import await_async, await_condition

METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
CHUNK = 256
PROMPT = tuple(range(3000, 3000 + 8 * CHUNK))
HASHES = tuple(token_chunk_hashes(PROMPT, CHUNK))
LAYOUT = LayoutSpec("flash_attn", 2, 64, 16, 2, 16, "float16")
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 16 * 2  # layers × K/V × tokens × heads × dim × 2 bytes


async def get(url: str) -> tuple[int, str, bytes]:
    """Status, content type and body of a GET (in a thread: urllib blocks)."""

    def fetch(method: str = "GET") -> tuple[int, str, bytes]:
        try:
            with urllib.request.urlopen(urllib.request.Request(url), timeout=5) as reply:
                return reply.status, reply.headers["content-type"], reply.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers["content-type"], error.read()

    return await trio.to_thread.run_sync(fetch)


async def scrape(server: ServerHandle) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus_client's parser: (name, labels) → value."""
    assert server.http_url is not None
    status, content_type, body = await get(server.http_url + "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def config(server_config: ServerConfig) -> ServerConfig:
    return attrs.evolve(server_config, http="127.0.0.1:0")


async def test_metrics_count_requests_hits_misses_l1_and_l2(config: ServerConfig) -> None:
    async with serving(config, LAYOUT, [("memory", MemoryBackend())]) as (
        server,
        worker,
        scheduler,
    ):
        reply = await worker.call(Store("a", 0, 4 * CHUNK, HASHES[:4]), StoreReply)
        await worker.request(Commit("a", written=tuple(HASHES[s.chunk] for s in reply.slots)))
        for name in ("x", "y"):  # 4 of 8 chunks in L1 each time
            found = await scheduler.call(Lookup(name, "m", 1, HASHES), LookupReply)
            assert found == LookupReply(4 * CHUNK, 4)
        async with open_socket(zmq.DEALER) as raw:  # an operation no server knows
            raw.connect(server.endpoint)
            await raw.send_multipart(
                [msgpack.packb([PROTOCOL_VERSION, 1, "no-such-op"]), msgpack.packb({})]
            )
            await raw.recv_multipart()

        async def written() -> bool:
            samples = await scrape(server)
            key = ("kvtrio_l2_stores_total", (("backend", "memory"),))
            return samples.get(key, 0) == 4

        await await_async(written, what="the write-behind to reach the memory backend")
        samples = await scrape(server)

    assert value(samples, "kvtrio_requests_total", op="lookup", outcome="ok") == 2
    assert value(samples, "kvtrio_requests_total", op="store", outcome="ok") == 1
    assert value(samples, "kvtrio_requests_total", op="unknown", outcome="unknown_operation") == 1
    assert value(samples, "kvtrio_errors_total", code="unknown_operation") == 1
    assert value(samples, "kvtrio_request_duration_seconds_count", op="lookup") == 2
    assert value(samples, "kvtrio_request_duration_seconds_bucket", op="lookup", le="+Inf") == 2
    assert value(samples, "kvtrio_request_duration_seconds_sum", op="lookup") > 0
    assert value(samples, "kvtrio_lookups_total") == 2
    assert value(samples, "kvtrio_lookup_hit_chunks_total", tier="l1") == 8
    assert value(samples, "kvtrio_lookup_hit_chunks_total", tier="l2") == 0
    assert value(samples, "kvtrio_lookup_hit_tokens_total", tier="l1") == 8 * CHUNK
    assert value(samples, "kvtrio_lookup_miss_chunks_total") == 8
    assert value(samples, "kvtrio_lookup_miss_tokens_total") == 8 * CHUNK
    assert value(samples, "kvtrio_l1_capacity_bytes") == config.l1_size
    assert value(samples, "kvtrio_l1_used_bytes") == 4 * CHUNK_BYTES
    assert value(samples, "kvtrio_l1_entries", state="ready") == 4
    assert value(samples, "kvtrio_pins") == 8  # two lookups' pins (they were not ended)
    assert value(samples, "kvtrio_leases") == 8
    assert value(samples, "kvtrio_sessions") >= 2
    assert value(samples, "kvtrio_registrations") == 1
    assert value(samples, "kvtrio_phase", phase="serving") == 1
    assert value(samples, "kvtrio_l2_healthy", backend="memory") == 1
    assert value(samples, "kvtrio_l2_bytes_total", backend="memory", direction="stored") == (
        4 * CHUNK_BYTES
    )
    # One store operation per write-behind batch: the 4 chunks take 1 to 4 backend calls.
    stores = value(
        samples, "kvtrio_l2_operations_total", backend="memory", op="store", outcome="ok"
    )
    assert 1 <= stores <= 4
    assert (
        value(samples, "kvtrio_l2_operation_duration_seconds_count", backend="memory", op="store")
        == stores
    )
    assert (
        value(
            samples,
            "kvtrio_l2_operations_total",
            backend="memory",
            op="lookup_and_lock",
            outcome="ok",
        )
        == 2
    )
    assert value(samples, "kvtrio_write_behind_queue_depth") == 0
    assert value(samples, "kvtrio_write_behind_skipped_total") == 0
    # docs/metrics.md names every metric a server exposes.
    documented = set(re.findall(r"`(kvtrio_[a-z0-9_]+)`", METRICS_DOC.read_text()))
    for name, _ in samples:
        base = re.sub(r"_(bucket|sum|count|created)$", "", name)
        assert {base, base + "_total"} & documented, f"{name} is not in docs/metrics.md"


async def test_healthz_is_503_while_draining_and_the_request_in_flight_is_answered(
    config: ServerConfig,
) -> None:
    slow = FaultBackend(inner=MemoryBackend())
    config = attrs.evolve(config, lookup_timeout=1.5, drain_timeout=10.0)
    async with serving(config, LAYOUT, [("memory", slow)]) as (server, _, scheduler):
        assert server.http_url is not None
        assert await get(server.http_url + "/healthz") == (200, "text/plain", b"serving\n")
        slow.configure(latency=5.0)  # the lookup's L2 part holds it until its timeout
        answered: list[LookupReply] = []

        async def look_up() -> None:
            answered.append(await scheduler.call(Lookup("r", "m", 1, HASHES), LookupReply))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(look_up)
            await await_condition(lambda: server.state.pending == 1, what="the lookup in flight")
            nursery.start_soon(server.shutdown)

            async def draining() -> bool:
                return await get(server.http_url + "/healthz") == (  # type: ignore[operator]
                    503,
                    "text/plain",
                    b"draining\n",
                )

            await await_async(draining, what="/healthz to say draining")
            samples = await scrape(server)
            assert value(samples, "kvtrio_phase", phase="draining") == 1
            assert not answered  # still in flight: the drain waits for it
        assert answered == [LookupReply(0, 0)]


async def test_healthz_is_503_while_starting() -> None:
    state = ServerState(ServerConfig(l2=()), "ipc:///nowhere")
    app = HttpApp(state, ServerMetrics())
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/healthz"}
    await app(scope, receive, send)
    assert (sent[0]["status"], sent[1]["body"]) == (503, b"starting\n")
    state.serving = True
    sent.clear()
    await app(scope, receive, send)
    assert (sent[0]["status"], sent[1]["body"]) == (200, b"serving\n")


async def test_status_is_the_stats_document_and_names_no_backend_options(
    config: ServerConfig,
) -> None:
    config = attrs.evolve(config, l2=(BackendSpec("memory", {"password": "hunter2"}),))
    async with serving(config, LAYOUT, [("memory", MemoryBackend())]) as (server, worker, _):
        assert server.http_url is not None
        status, content_type, body = await get(server.http_url + "/status")
        stats = await worker.call(GetStats(), StatsReply)
    assert (status, content_type) == (200, "application/json")
    document = json.loads(body)
    expected = json.loads(json.dumps(status_document(stats)))
    for volatile in ("uptime_seconds", "requests", "sessions"):
        document.pop(volatile), expected.pop(volatile)
    assert document == expected
    assert document["phase"] == "serving"
    assert document["config"]["l2"] == ["memory"]
    assert document["l1"]["capacity_bytes"] == config.l1_size
    assert document["l2"][0]["name"] == "memory"
    assert b"hunter2" not in body
    assert "hunter2" not in json.dumps(config_summary(config))


async def test_other_paths_and_methods(config: ServerConfig) -> None:
    async with serving(config, LAYOUT, [("memory", MemoryBackend())]) as (server, _, _):
        assert server.http_url is not None
        status, _, _ = await get(server.http_url + "/nope")
        assert status == 404

        def post() -> int:
            request = urllib.request.Request(server.http_url + "/metrics", data=b"", method="POST")  # type: ignore[operator]
            try:
                urllib.request.urlopen(request, timeout=5)
            except urllib.error.HTTPError as error:
                return error.code
            return 200

        assert await trio.to_thread.run_sync(post) == 405


async def test_a_taken_port_is_a_clear_error(config: ServerConfig) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"http: cannot listen on 127.0.0.1:{port}"):
            async with open_server(attrs.evolve(config, http=f"127.0.0.1:{port}")):
                pass  # pragma: no cover


def test_http_setting_is_off_by_default_and_binds_loopback() -> None:
    from kvtrio.config import load_config
    from kvtrio.options import parse_http_address

    assert ServerConfig().http == ""
    assert parse_http_address("9464") == ("127.0.0.1", 9464)
    assert parse_http_address("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert parse_http_address("[::1]:9464") == ("::1", 9464)
    with pytest.raises(ConfigError, match="not PORT or HOST:PORT"):
        load_config({"http": "nine"})
