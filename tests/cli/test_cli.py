"""The ``kvtrio`` command as a user runs it: real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtrio.client import Client
from kvtrio.launch import ServerProcess
from kvtrio.protocol import ChunkSize, GetChunkSize

from .._support.command import KVTRIO, run
from .._support.waiting import wait_for


def test_serve_on_the_defaults_answers_ping_and_stops_on_sigterm(short_dir: Path) -> None:
    proc = subprocess.Popen(
        [KVTRIO, "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=short_dir,
    )
    try:
        wait_for(lambda: run("ping").returncode == 0, what="kvtrio ping to succeed")
        pong = run("ping")
        assert pong.stdout.startswith("pong from tcp://127.0.0.1:5577")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=15)
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert proc.returncode == 0
    assert "serving on tcp://127.0.0.1:5577" in output
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


def test_ping_without_a_server_is_a_one_line_error(endpoint: str) -> None:
    result = run("ping", endpoint)
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == f"kvtrio: error: cannot reach {endpoint} (no connection; is the server running?)"
    )


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
