"""Issue 22 item 8: what the operator sees is true (status, /healthz, metrics, sizes, plain tcp).

Each test here failed on 04cca5e: an unusable disk L2 read ``healthy``; ``--l1-size 10`` was a
10-byte L1; a client made the default keys and could not reach an ``--insecure`` server.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kvtrio.client import Client
from kvtrio.launch import ServerProcess
from kvtrio.protocol import Ping

from .._support.command import run
from .._support.waiting import wait_for


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_an_l2_that_cannot_be_used_is_unhealthy_with_the_reason_everywhere(
    server_process: Callable[..., ServerProcess],
) -> None:
    """Was: ``disk /proc/nope (up to 32GiB): healthy`` in ``kvtrio status``, ``"healthy":
    true`` in its JSON, and ``/healthz`` said ``serving``. (A disk path that can never work now
    stops the start, issue 32; a store that is down is the failure that may mend itself.)"""
    down = f"redis://127.0.0.1:{_free_port()}/0"  # (nothing listens there)
    server = server_process("--l2", f"redis:url={down}", "--http", "127.0.0.1:0")
    url = wait_for(lambda: re.search(r"HTTP on (http://\S+)", server.log()), what="HTTP").group(1)

    def status() -> dict:  # type: ignore[type-arg]
        result = run("status", "--json", server.endpoint)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)  # type: ignore[no-any-return]

    entry = wait_for(lambda: status()["l2"][0] if "problem" in status()["l2"][0] else None)
    assert entry["healthy"] is False
    where = down.removeprefix("redis://").removesuffix("/0")
    assert where in entry["problem"], entry
    text = run("status", server.endpoint).stdout.splitlines()
    line = next(line for line in text if line.startswith(f"redis {down}"))
    assert where in line.partition("UNHEALTHY (")[2], line
    code, body = _get(f"{url}/healthz")
    assert (code, body.splitlines()[0]) == (200, "degraded"), body
    assert where in body.partition("L2 redis: UNHEALTHY (")[2], body
    assert _get(f"{url}/healthz?strict")[0] == 503
    _, metrics = _get(f"{url}/metrics")
    assert 'kvtrio_l2_healthy{backend="redis"} 0.0' in metrics


def test_a_size_without_a_unit_below_a_mebibyte_is_refused_with_a_hint() -> None:
    """Was: ``--l1-size 10`` started (or tried to) with a 10-byte L1."""
    result = run("serve", "--l1-size", "10", "--l2", "none")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "kvtrio: error: invalid setting: l1_size = '10' (from --l1-size): a size without a "
        "unit is bytes; did you mean 10GiB or 10MiB? (10B for 10 bytes)"
    ]


def _plain_server(short_dir: Path) -> ServerProcess:
    """``kvtrio serve --insecure`` on loopback tcp, with keys of its own nowhere near the
    client's (a server started with --insecure makes none)."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    env = {
        **os.environ,
        "KVTRIO_L1_SIZE": "64MiB",
        "KVTRIO_L2": "none",
        "KVTRIO_KEY_DIR": str(short_dir / "server-keys"),
    }
    return ServerProcess(
        endpoint, ["--insecure"], env, log_path=short_dir / "server.log", server_key="none"
    ).start()


def test_a_plain_server_is_reached_by_a_client_told_so_and_no_client_makes_keys(
    short_dir: Path,
) -> None:
    """Was: ``kvtrio ping`` made the default keys, spoke CURVE to the plain server and failed
    with "the handshake with the server failed"; no client setting said plain."""
    keys = short_dir / "client-keys"
    env = {**os.environ, "KVTRIO_KEY_DIR": str(keys)}
    env.pop("KVTRIO_SERVER_KEY", None)
    with _plain_server(short_dir) as server:
        ping = run("ping", server.endpoint, "--insecure", env=env)
        assert ping.returncode == 0, ping.stderr
        assert ping.stdout.startswith(f"pong from {server.endpoint}")
        plain_env = {**env, "KVTRIO_INSECURE": "1"}
        assert run("status", server.endpoint, env=plain_env).returncode == 0

        # Without being told: no keys are made, and the message says what to do.
        refused = run("ping", server.endpoint, "--timeout", "1", env=env)
        assert refused.returncode != 0
        message = refused.stderr.strip()
        assert len(message.splitlines()) == 1, message
        assert "--insecure" in message, message
        assert str(keys) in message, message
        assert not keys.exists()

        # With keys (this user once ran a CURVE server): the handshake says who speaks what.
        run("keygen", "server", "--dir", str(keys))
        run("keygen", "client", "--dir", str(keys), "--tenants", "*")
        curve = run("ping", server.endpoint, "--timeout", "1", env=env)
        assert curve.returncode == 1
        # ZeroMQ reports the mismatch (a server that speaks plain) when the client reads the
        # server's greeting before the server closed; else two closes, which say both causes.
        said = curve.stderr
        assert "speaks plain ZeroMQ" in said, said
        assert "--insecure" in said, said


def test_the_server_answers_promptly_right_after_serving(
    server_process: Callable[..., ServerProcess],
) -> None:
    """Was: the L1's pages were mapped after "serving" in one call that held the process's
    memory-map lock for seconds: pings right after the start took up to 3.6 s here (4 GiB).
    The worst of the pings in the first 4 s after the server answered, with a 3 GiB L1: a
    guard against stalls of seconds, loose enough for a loaded machine (a new client's ping
    took up to 1.4 s under two busy loops on 2 shared cores; the lock itself is held per
    slice: tests/shm/test_arena.py). On 04cca5e it failed 1 run in 2 (1.6 s)."""
    server = server_process("--l1-size", "3GiB")  # answers a ping: it printed "serving"
    worst, end = 0.0, time.monotonic() + 4
    while time.monotonic() < end:
        started = time.monotonic()
        with Client(server.endpoint, timeout=10, heartbeat=False) as client:  # as kvtrio ping
            client.request(Ping())
        worst = max(worst, time.monotonic() - started)
    assert worst < 2.0, f"a new client's ping took {worst * 1000:.0f} ms right after the start"
