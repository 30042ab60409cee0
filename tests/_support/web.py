"""Talking to an HTTP server on loopback (vLLM's API server, kvtrio's /metrics) in tests."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

__all__ = ["free_port", "http", "prometheus"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    """GET ``url`` (POST ``body`` as JSON, if given): the status and the body."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())


def prometheus(metrics: str, name: str) -> float:
    """The sum of a metric's samples in Prometheus' text format."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith((f"{name}{{", f"{name} "))
    )
