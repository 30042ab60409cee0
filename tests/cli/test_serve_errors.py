"""Issue 32: what stops ``kvtrio serve`` says so in one line, and a clean stop leaves nothing.

Each test here failed on 1bb9379: a second server on a disk L2 directory in use started and
shared it (each overwrote the other's records); a disk L2 path that can never work started and
served with the L2 skipped for ever; ``--ipc-group nosuchgroup`` on tcp printed a 62-line
traceback and ``--ipc-group 1000`` was refused; ipc socket files stayed after a clean stop.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from kvtrio.launch import ServerProcess, ServerStartError

from .._support.command import run

ENV = {**os.environ, "KVTRIO_L1_SIZE": "64MiB", "KVTRIO_L2": "none", "KVTRIO_DRAIN_TIMEOUT": "1"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _one_error_line(output: str) -> str:
    """The one error line (the last), with no traceback before it (the log lines of a start
    that got as far as the L2's probe may come first)."""
    lines = output.strip().splitlines()
    assert [line for line in lines if line.startswith("kvtrio: error: ")] == lines[-1:], output
    assert "Traceback" not in output, output
    assert "ExceptionGroup" not in output, output
    return lines[-1]


def _server(short_dir: Path, name: str, *args: str) -> ServerProcess:
    return ServerProcess(
        f"ipc://{short_dir}/{name}.sock", list(args), ENV, log_path=short_dir / f"{name}.log"
    )


def test_a_second_server_on_a_disk_l2_in_use_stops_in_one_line_and_a_killed_ones_does_not(
    short_dir: Path,
) -> None:
    disk = ("--l2", f"disk:path={short_dir / 'l2'}")
    first = _server(short_dir, "first", *disk).start()
    second = _server(short_dir, "second", *disk)
    with pytest.raises(ServerStartError, match="exited with 2"):
        second.start()
    assert _one_error_line(second.log()) == (
        f"kvtrio: error: L2 backend disk: disk: {short_dir / 'l2'} is in use by another kvtrio "
        f"server (pid {first.pid}); give each server a path of its own (two servers on one "
        "directory overwrite each other's objects)"
    )
    first.kill()  # kill -9: the kernel drops its lock
    with second.start():
        assert "in use" not in second.log().splitlines()[-1]
    with first:  # and after a clean stop too
        pass


@pytest.mark.parametrize("where", ["proc", "under_a_file"])
def test_a_disk_l2_path_that_can_never_work_stops_the_start_in_one_line(
    short_dir: Path, where: str
) -> None:
    (short_dir / "file").write_text("x")
    path = "/proc/kvtrio-nope/l2" if where == "proc" else f"{short_dir}/file/l2"
    endpoint = f"ipc://{short_dir}/s.sock"
    result = run("serve", "--endpoint", endpoint, "--l2", f"disk:path={path}", env=ENV)
    assert result.returncode == 2, result.stderr
    line = _one_error_line(result.stderr)
    reason = "No such file or directory" if where == "proc" else "Not a directory"
    assert line.startswith(f"kvtrio: error: L2 backend disk: disk: cannot use {path}: {reason}")
    assert not (short_dir / "s.sock").exists()


def test_a_bad_ipc_group_stops_any_start_in_one_line() -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    result = run(
        "serve", "--endpoint", endpoint, "--insecure", "--ipc-group", "nosuchgroup", env=ENV
    )
    assert result.returncode == 2
    assert _one_error_line(result.stderr) == (
        "kvtrio: error: invalid setting: ipc_group = 'nosuchgroup' (from --ipc-group): no group "
        "named 'nosuchgroup' (give a group name or a numeric id)"
    )


def test_a_numeric_ipc_group_is_a_group_id(short_dir: Path) -> None:
    gid = 4242 if os.getgid() == 0 else os.getgid()  # (any id, as root; our own otherwise)
    server = _server(short_dir, "s", "--ipc-group", str(gid), "--events", f"ipc://{short_dir}/ev")
    with server:
        for name in ("s.sock", "ev", "ev.replay"):
            status = (short_dir / name).stat()
            assert (status.st_gid, status.st_mode & 0o777) == (gid, 0o660), name


def test_a_clean_stop_removes_the_ipc_socket_files_it_bound(short_dir: Path) -> None:
    server = _server(short_dir, "s", "--events", f"ipc://{short_dir}/ev")
    with server:
        assert {p.name for p in short_dir.iterdir()} >= {"s.sock", "ev", "ev.replay"}
    assert server.stop() == 0
    left = {p.name for p in short_dir.iterdir()} - {"s.log"}
    assert left == set(), left


def test_a_killed_servers_socket_files_do_not_block_a_restart(short_dir: Path) -> None:
    server = _server(short_dir, "s", "--events", f"ipc://{short_dir}/ev")
    with server:
        server.stop(signal.SIGKILL)
    assert (short_dir / "s.sock").exists()  # (left behind: nobody removed them)
    with server:
        pass
    assert not (short_dir / "s.sock").exists()
