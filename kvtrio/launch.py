"""Start ``kvtrio serve`` as a child process and wait until it answers: the one launcher that
``kvtrio bench``, the scripts under ``bench/`` and the test suite use.

    from kvtrio.launch import ServerProcess, launch_server

    with launch_server("--l1-size", "1GiB") as server:   # ipc endpoint in a temporary dir
        use(server.endpoint)

    server = ServerProcess(endpoint, ["--l2", "none"], log_path=path).start()
    ...
    server.stop()                        # SIGTERM, then SIGKILL if it does not exit in time

A server counts as up once it answers a ``ping`` (polled with a deadline, never a fixed sleep);
one that exits first, or does not answer in time, raises :class:`ServerStartError` with the end
of its log. It is stopped by its PID, never by name.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from .client import Client
from .errors import ConfigError, KvtrioError
from .protocol import Ping

__all__ = ["ServerProcess", "ServerStartError", "launch_server"]


class ServerStartError(RuntimeError):
    """``kvtrio serve`` exited while starting, or did not answer in time."""


class ServerProcess:
    """A ``kvtrio serve`` child process on ``endpoint`` with extra ``args``.

    ``env`` is its whole environment (default: this process's); its output goes to
    ``log_path`` (appended; default: this process's stdout and stderr). ``new_session``: its
    own process session (setsid), so that a Ctrl-C meant for the caller does not drain the
    server under it.
    ``server_key`` is the server key the readiness check uses (``none`` for plain tcp).
    :meth:`start` may be called again after :meth:`stop` (same endpoint and arguments).
    """

    def __init__(
        self,
        endpoint: str,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        log_path: Path | None = None,
        new_session: bool = False,
        server_key: str | None = None,
        python: str = sys.executable,
    ) -> None:
        self.endpoint = endpoint
        self.args = list(args)
        self.env = dict(env) if env is not None else None
        self.log_path = log_path
        self.new_session = new_session
        self.server_key = server_key
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        return [self.python, "-m", "kvtrio", "serve", "--endpoint", self.endpoint, *self.args]

    def start(self, timeout: float = 30.0) -> ServerProcess:
        """Start the process and wait (blocking, at most ``timeout`` seconds) until it answers
        a ping; :class:`ServerStartError` if it exits first or does not answer (it is stopped
        then)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        output: IO[Any] | None = None
        if self.log_path is not None:
            output = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.command,
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                env=self.env,
                start_new_session=self.new_session,
            )
        finally:
            if output is not None:
                output.close()
        try:
            self._wait_until_up(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_up(self, timeout: float) -> None:
        proc = self.proc
        assert proc is not None
        deadline = time.monotonic() + timeout
        with self._ready_client(proc, deadline, timeout) as client:
            delay = 0.005
            while True:
                if proc.poll() is not None:
                    raise ServerStartError(
                        f"kvtrio serve exited with {proc.returncode}: {self.log_tail()}"
                    )
                with contextlib.suppress(KvtrioError):
                    client.request(Ping())
                    return
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"kvtrio serve did not answer within {timeout:g} s: {self.log_tail()}"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.1)

    def _ready_client(
        self, proc: subprocess.Popen[bytes], deadline: float, timeout: float
    ) -> Client:
        """The readiness check's client, once it can be made: a client never creates keys,
        and on its first start the server creates the default ones (a :class:`ConfigError`
        until then)."""
        delay = 0.005
        while True:
            try:
                return Client(
                    self.endpoint, timeout=0.5, heartbeat=False, server_key=self.server_key,
                    client_name="kvtrio-launch",
                )  # fmt: skip
            except ConfigError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise ServerStartError(
                        f"kvtrio serve made no keys within {timeout:g} s: {self.log_tail()}"
                    ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Signal the process (by PID) and wait for it; SIGKILL if it does not exit within
        ``timeout``. Its exit status (None if it never started)."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log(self) -> str:
        """Everything in the log file so far (empty without one)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self) -> str:
        """The log's last line, for an error message."""
        lines = self.log().strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def __enter__(self) -> ServerProcess:
        return self if self.proc is not None and self.proc.poll() is None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def launch_server(
    *args: str,
    env: Mapping[str, str] | None = None,
    log: bool = True,
    timeout: float = 30.0,
    new_session: bool = False,
    directory: str | None = None,
) -> Iterator[ServerProcess]:
    """A :class:`ServerProcess` on an ipc endpoint in a new temporary directory (under
    ``directory``, default ``/tmp``: ipc paths must stay short), which also holds its log
    (``server.log``, with ``log``); stopped and the directory removed afterwards."""
    workdir = Path(tempfile.mkdtemp(prefix="kvtrio-", dir=directory or _short_tmp()))
    try:
        server = ServerProcess(
            f"ipc://{workdir}/kvtrio.sock",
            args,
            env,
            log_path=workdir / "server.log" if log else None,
            new_session=new_session,
        )
        with server.start(timeout):
            yield server
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _short_tmp() -> str | None:
    return "/tmp" if Path("/tmp").is_dir() else None
