"""The server's HTTP endpoint: ``/metrics``, ``/healthz``, ``/status``.

A minimal ASGI application served by hypercorn's trio worker inside the server's own nursery, so
it shares the event loop with the ZeroMQ side and is cancelled with it. Handlers only read state
(one snapshot per request); the metrics text is rendered in a worker thread. hypercorn is
imported only when HTTP is turned on.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

from .._logging import event
from ..errors import ConfigError
from ..options import parse_http_address
from ._metrics import CONTENT_TYPE, ServerMetrics
from ._state import ServerState
from ._status import status_document

__all__ = ["HttpApp", "bind_http", "serve_http"]

log = logging.getLogger("kvtrio.http")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_hypercorn_log = logging.getLogger("kvtrio.http.hypercorn")
_hypercorn_log.setLevel(logging.WARNING)  # its "Running on" line: we log our own


class HttpApp:
    """The ASGI application (HTTP and lifespan scopes; GET and HEAD only)."""

    def __init__(self, state: ServerState, metrics: ServerMetrics) -> None:
        self.state = state
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["method"] not in ("GET", "HEAD"):
            await _respond(send, 405, b"method not allowed\n", "text/plain", [(b"allow", b"GET")])
            return
        path = scope["path"]
        if path == "/metrics":
            await _respond(send, 200, await self.metrics.render(self.state.stats()), CONTENT_TYPE)
        elif path == "/healthz":
            strict = b"strict" in scope.get("query_string", b"").split(b"&")
            status, text = self._health(strict)
            await _respond(send, status, text.encode(), "text/plain")
        elif path == "/status":
            body = json.dumps(status_document(self.state.stats()), indent=2).encode() + b"\n"
            await _respond(send, 200, body, "application/json")
        else:
            await _respond(
                send, 404, b"not found: try /metrics, /healthz or /status\n", "text/plain"
            )

    def _health(self, strict: bool) -> tuple[int, str]:
        """``/healthz``: 503 and the phase while starting or draining; 200 ``serving``; 200
        ``degraded`` and a line per unhealthy L2 backend (with the reason) while one is, or
        503 with ``?strict``. Degraded is still 200 by default: the server answers and L1
        serves, and a liveness probe that restarts it would lose L1 and not mend the L2."""
        phase = self.state.phase
        if phase != "serving":
            return 503, f"{phase}\n"
        cache = self.state.cache
        unhealthy = [b for b in (cache.l2_stats() if cache else ()) if b.healthy is False]
        if not unhealthy:
            return 200, "serving\n"
        lines = [f"L2 {b.name}: UNHEALTHY ({b.problem or 'failing'})" for b in unhealthy]
        return (503 if strict else 200), "degraded\n" + "\n".join(lines) + "\n"

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type.encode()),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def bind_http(address: str) -> socket.socket:
    """A listening TCP socket on ``address`` (``PORT`` or ``HOST:PORT``), bound before the server
    starts anything else; :class:`ConfigError` in one line if it cannot be."""
    host, port = parse_http_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as exc:
        raise ConfigError(f"http: cannot listen on {address}: {exc.strerror}") from None


async def serve_http(
    state: ServerState,
    metrics: ServerMetrics,
    sock: socket.socket,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the HTTP endpoint on the listening socket ``sock`` until cancelled.

    Starts once hypercorn listens (``task_status.started`` gets ``http://HOST:PORT``).
    Cancellation closes the listener and open connections.
    """
    from hypercorn.config import Config, Sockets
    from hypercorn.trio.run import worker_serve
    from hypercorn.utils import wrap_app

    config = Config()
    config.accesslog = None
    config.errorlog = _hypercorn_log
    config.graceful_timeout = 0.5
    sockets = Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[])
    app = wrap_app(HttpApp(state, metrics), config.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(functools.partial(worker_serve, app, config, sockets=sockets))
        url = binds[0] if binds else "http://?"
        log.info("HTTP on %s (/metrics, /healthz, /status)", url, extra=event("http", url=url))
        task_status.started(url)
