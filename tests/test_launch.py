"""The one launcher of ``kvtrio serve`` (used by ``kvtrio bench``, bench/ and these tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtrio.client import Client
from kvtrio.launch import ServerProcess, ServerStartError, launch_server
from kvtrio.protocol import ChunkSize, GetChunkSize

ENV = {**os.environ, "KVTRIO_L1_SIZE": "64MiB", "KVTRIO_L2": "none"}


def test_a_launched_server_answers_and_its_directory_goes_away() -> None:
    with launch_server("--chunk-size", "512", env=ENV) as server:
        directory = Path(server.endpoint.removeprefix("ipc://")).parent
        with Client(server.endpoint) as client:
            assert client.call(GetChunkSize(), ChunkSize).chunk_size == 512
        assert server.proc is not None
    assert server.proc.returncode == 0  # stopped with SIGTERM: drained, exit status 0
    assert not directory.exists()


def test_a_server_that_cannot_start_says_why(short_dir: Path) -> None:
    server = ServerProcess(
        f"ipc://{short_dir}/s.sock", ["--chunk-size", "7"], ENV, log_path=short_dir / "log"
    )
    with pytest.raises(ServerStartError, match=r"exited with 2: .*chunk_size"):
        server.start()
    assert server.proc is not None
    assert server.proc.poll() is not None


def test_restart_keeps_the_endpoint(short_dir: Path) -> None:
    server = ServerProcess(f"ipc://{short_dir}/s.sock", [], ENV, log_path=short_dir / "log")
    with server:
        first = server.pid
    assert server.stop() == 0
    with server:
        assert server.pid != first
        with Client(server.endpoint) as client:
            assert client.call(GetChunkSize(), ChunkSize).chunk_size == 256
