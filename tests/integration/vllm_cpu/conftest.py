"""What the real vLLM CPU engine tests share: a module's work folder and its kvtrio server.

A module that needs another server (other settings, other ranks) defines its own ``kvtrio``
fixture, which pytest then uses instead of this one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtrio.launch import ServerProcess

from ..._support.vllm_cpu import CHUNK
from ..._support.web import free_port


@pytest.fixture(scope="module")
def workdir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's folder: its model, its engines' jobs, results and logs, the server's log."""
    name = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    return tmp_path_factory.mktemp(f"vllm-cpu-{name}")


@pytest.fixture(scope="module")
def kvtrio(workdir: Path) -> Iterator[ServerProcess]:
    """A ``kvtrio serve`` process for the module: chunks of :data:`CHUNK` tokens, 128 MiB of
    L1, no L2, its log in ``workdir/kv.log``; stopped after the module."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVTRIO_L2": "none", "KVTRIO_DRAIN_TIMEOUT": "1"}
    args = ["--chunk-size", str(CHUNK), "--l1-size", "128MiB"]
    server = ServerProcess(f"tcp://127.0.0.1:{free_port()}", args, env, log_path=workdir / "kv.log")
    server.start()
    yield server
    server.stop()
