"""Fixtures shared by the whole suite: endpoints, in-process servers, server processes."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import kvtrio.l2._diskio
from kvtrio.config import ServerConfig
from kvtrio.launch import ServerProcess
from kvtrio.server import ServerHandle, serve

from ._support.disk_faults import BadRecords
from ._support.lengths import report_long_modules


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """The module-length report of ``tests/test_layers.py``, after the run's results."""
    report_long_modules(terminalreporter, config)


@pytest.fixture(scope="session", autouse=True)
def _private_key_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The suite's servers and clients use default CURVE keys of their own, never the user's
    (``~/.config/kvtrio/keys``); server processes inherit the setting. The keys exist from the
    start, as after a server's first start: a client never creates them, and a test may start
    a client before its server."""
    from kvtrio.transport import ensure_default_keys

    previous = os.environ.get("KVTRIO_KEY_DIR")
    directory = tmp_path_factory.mktemp("kvtrio-keys") / "keys"
    os.environ["KVTRIO_KEY_DIR"] = str(directory)
    ensure_default_keys(directory)
    yield
    if previous is None:
        del os.environ["KVTRIO_KEY_DIR"]
    else:
        os.environ["KVTRIO_KEY_DIR"] = previous


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short temporary directory (ipc:// paths must stay under ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def endpoint(short_dir: Path) -> str:
    return f"ipc://{short_dir}/s.sock"


@pytest.fixture
def server_config(request: pytest.FixtureRequest, endpoint: str) -> ServerConfig:
    """Test server settings; parametrize indirectly with a dict to override fields. Every
    committed chunk is written to an L2 the test gives (``l2_admission="all"``: the tests of
    the L2 tier are about what happens to written chunks; admission has tests of its own)."""
    overrides = getattr(request, "param", {})
    defaults = {"endpoint": endpoint, "drain_timeout": 2.0, "l1_size": 64 << 20, "l2": ()}
    return ServerConfig(**{**defaults, "l2_admission": "all", **overrides})


@pytest.fixture
async def server(nursery: trio.Nursery, server_config: ServerConfig) -> AsyncIterator[ServerHandle]:
    """A server running in the test's own trio loop."""
    handle: ServerHandle = await nursery.start(serve, server_config)
    yield handle
    handle.stop()


# --------------------------------------------------------------------------- server processes
# ServerProcess (kvtrio.launch) is the one launcher of `kvtrio serve`, shared with `kvtrio bench`
# and the scripts under bench/; tests import it from here.


@pytest.fixture
def server_process(short_dir: Path, endpoint: str) -> Iterator[Callable[..., ServerProcess]]:
    """Factory: ``server_process(*extra_args)`` starts ``kvtrio serve`` and waits for it."""
    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        full_env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "KVTRIO_L1_SIZE": "64MiB",
            "KVTRIO_L2": "none",
            "KVTRIO_L2_ADMISSION": "all",  # (as server_config)
            "KVTRIO_DRAIN_TIMEOUT": "1",
            **(env or {}),
        }
        process = ServerProcess(endpoint, list(args), full_env, log_path=short_dir / "server.log")
        started.append(process)
        return process.start()

    yield start
    for process in started:
        if process.proc is not None and process.proc.poll() is None:
            process.stop(signal.SIGTERM)  # gracefully: the server removes its L1 arena


# --------------------------------------------------------------------------- CUDA sources


@pytest.fixture(scope="session")
def host_library(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The host build of the CUDA kernels' index arithmetic (``kvtrio_host.cpp``), via ctypes.

    Skipped without a C++ compiler, except where ``KVTRIO_REQUIRE_CUDA_BUILD=1`` (the ``cuda``
    tox env) makes that a failure.
    """
    from kvtrio.transfer._cuda_build import build_host_library
    from kvtrio.transfer._hostlib import HostLibrary

    try:
        path = build_host_library(tmp_path_factory.mktemp("hostlib"))
    except RuntimeError as exc:
        if os.environ.get("KVTRIO_REQUIRE_CUDA_BUILD", "") not in ("", "0"):
            raise
        pytest.skip(f"cannot build the host library: {exc}")
    return HostLibrary(path)


@pytest.fixture
def fault_registered() -> Iterator[None]:
    """Register the test backend ``fault`` (:class:`kvtrio.testing.FaultBackend`, which kvtrio
    does not install) for this test with :func:`kvtrio.l2.register`, as a test-only plugin's
    entry point would: ``create_backend("fault", …)`` and an in-process server's
    ``--l2 fault:…`` find it. A server process does not (it reads the installed metadata)."""
    from kvtrio.l2 import register, unregister

    register("fault", "kvtrio.testing:FaultBackend")
    try:
        yield
    finally:
        unregister("fault")


@pytest.fixture
def bad_records() -> Iterator[BadRecords]:
    """The disk L2's reads fail where the test says (:class:`BadRecords`)."""
    saved = kvtrio.l2._diskio.os
    fake = BadRecords()
    kvtrio.l2._diskio.os = fake  # type: ignore[assignment]
    try:
        yield fake
    finally:
        kvtrio.l2._diskio.os = saved
