"""The ``kvtrio`` command as a user runs it: real processes, real signals."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtrio.cli import DEFAULT_ENDPOINT, _build_parser
from kvtrio.client import Client
from kvtrio.config import load_config
from kvtrio.launch import ServerProcess
from kvtrio.protocol import ChunkSize, GetChunkSize

from .._support.command import KVTRIO, run
from .._support.waiting import wait_for
from .._support.web import free_port


def test_serve_and_ping_default_to_the_same_endpoint() -> None:
    parser = _build_parser()
    assert DEFAULT_ENDPOINT == "tcp://127.0.0.1:5577"
    assert parser.parse_args(["ping"]).endpoint == DEFAULT_ENDPOINT
    assert parser.parse_args(["status"]).endpoint == DEFAULT_ENDPOINT
    assert load_config({}).endpoint == DEFAULT_ENDPOINT  # what `kvtrio serve` binds


def test_serve_on_the_defaults_answers_ping_and_stops_on_sigterm(short_dir: Path) -> None:
    """The defaults but the port: a free one, not 5577, which anything on the machine may hold
    (the test above checks that serve and ping agree on the default)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [KVTRIO, "serve", "--endpoint", endpoint],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=short_dir,
    )
    try:
        wait_for(lambda: run("ping", endpoint).returncode == 0, what="kvtrio ping to succeed")
        pong = run("ping", endpoint)
        assert pong.stdout.startswith(f"pong from {endpoint}")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=15)
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert proc.returncode == 0
    assert f"serving on {endpoint}" in output
    assert "SIGTERM: draining" in output
    assert "stopped" in output
    assert "Traceback" not in output


def test_python_dash_m_and_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvtrio", "--version"], capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith("kvtrio ")


@pytest.mark.parametrize(
    ("args", "env", "fragment"),
    [
        (["--chunk-size", "abc"], {}, "chunk_size = 'abc' (from --chunk-size)"),
        (["--l1-size", "lots"], {}, "is not a size"),
        (
            [],
            {"KVTRIO_HEARTBEAT_TIMEOUT": "-3"},
            "from environment variable KVTRIO_HEARTBEAT_TIMEOUT",
        ),
        (["--config", "/nonexistent.toml"], {}, "cannot read config file"),
        (["--endpoint", "udp://x"], {}, "over tcp:// or ipc://, not udp://"),
    ],
)
def test_bad_settings_are_one_line_errors(
    args: list[str], env: dict[str, str], fragment: str
) -> None:
    result = run("serve", *args, env={**os.environ, **env})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvtrio: error: invalid setting") or "cannot read" in lines[0]
    assert fragment in lines[0]


def test_ping_without_a_server_is_a_one_line_error_after_its_timeout(endpoint: str) -> None:
    """--timeout is how long ping waits for a server to listen (it failed in 0.7 s with
    --timeout 10: issue 32)."""
    started = time.monotonic()
    result = run("ping", endpoint, "--timeout", "3")
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"kvtrio: error: waited 3 s for a kvtrio server at {endpoint}: nothing listens there "
        "(is the server running?)"
    )
    assert 3 <= elapsed < 3 + 20, elapsed  # the wait, then Python's start and exit under load


def _zeromq_started(pid: int) -> bool:
    """The process has made its ZeroMQ context (libzmq's eventfd): its client is connecting."""
    fds = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        return any("eventfd" in os.readlink(fd) for fd in fds.iterdir())
    return False


@pytest.mark.parametrize("keys", ["made-before", "made-by-the-server"])
def test_ping_started_before_the_server_waits_for_it(short_dir: Path, keys: str) -> None:
    """`kvtrio serve … &` then `kvtrio ping --timeout N`, as the docs run them: ping waits for
    the server to listen (and, on a first start, to make the default keys) instead of failing
    at once."""
    env = dict(os.environ)
    if keys == "made-by-the-server":  # a user's first start: no keys until the server makes them
        env["KVTRIO_KEY_DIR"] = str(short_dir / "keys")
        endpoint = f"tcp://127.0.0.1:{free_port()}"
    else:
        endpoint = f"ipc://{short_dir}/late.sock"
    ping = subprocess.Popen(
        [KVTRIO, "ping", endpoint, "--timeout", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    serve = [KVTRIO, "serve", "--endpoint", endpoint, "--l1-size", "64MiB", "--l2", "none"]
    server: subprocess.Popen[bytes] | None = None
    try:
        if keys == "made-before":  # ping is connecting before the server starts
            wait_for(lambda: _zeromq_started(ping.pid) or ping.poll() is not None,
                     timeout=30, what="ping to start connecting")  # fmt: skip
        assert ping.poll() is None, ping.communicate()
        with (short_dir / "server.log").open("wb") as log:
            server = subprocess.Popen(serve, env=env, stdout=log, stderr=subprocess.STDOUT)
        stdout, stderr = ping.communicate(timeout=60)
    finally:
        if ping.poll() is None:
            ping.kill()
            ping.communicate()
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    assert ping.returncode == 0, stderr + (short_dir / "server.log").read_text()
    assert stdout.startswith(f"pong from {endpoint}: instance ")


def test_an_ipc_endpoint_in_use_is_refused(server_process: Callable[..., ServerProcess]) -> None:
    server = server_process()
    result = run("serve", "--endpoint", server.endpoint)
    assert result.returncode == 1
    assert "is in use by another process" in result.stderr
    assert "Traceback" not in result.stderr
    assert run("ping", server.endpoint).returncode == 0  # the running server kept its socket


def test_settings_from_file_env_and_flags(
    server_process: Callable[..., ServerProcess], short_dir: Path
) -> None:
    config = short_dir / "kvtrio.toml"
    config.write_text("chunk_size = 512\n")
    server = server_process("--config", str(config), env={"KVTRIO_CHUNK_SIZE": "1024"})
    with Client(server.endpoint) as client:
        assert client.call(GetChunkSize(), ChunkSize).chunk_size == 512
    server.stop()
    server.args = ["--config", str(config), "--chunk-size", "128"]
    server.start()
    with Client(server.endpoint) as client:
        assert client.call(GetChunkSize(), ChunkSize).chunk_size == 128


def test_sigint_twice_stops_without_a_traceback(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--drain-timeout", "60")
    assert server.proc is not None
    server.proc.send_signal(signal.SIGINT)
    wait_for(lambda: "draining" in server.log(), what="the drain to start")
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(timeout=15) in (0, 130)
    assert "Traceback" not in server.log()
