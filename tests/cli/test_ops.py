"""Operating a server from the command line: ``kvtrio status``, structured logs."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

from kvtrio.client import Client
from kvtrio.launch import ServerProcess
from kvtrio.protocol import Ping

from .._support.command import run


def test_status_prints_the_status_document_over_zeromq(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process()
    result = run("status", "--json", server.endpoint)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["phase"] == "serving"
    assert status["config"]["endpoint"] == server.endpoint
    assert status["config"]["l2"] == []
    assert status["l1"]["capacity_bytes"] == 64 << 20
    assert status["sessions"]["live"] >= 1  # the status command's own session
    assert {"version", "instance_id", "uptime_seconds", "lookups", "l2"} <= status.keys()


def test_status_of_no_server_is_one_line(short_dir: Path) -> None:
    result = run("status", f"ipc://{short_dir}/none.sock", "--timeout", "0.5")
    assert result.returncode == 1
    assert result.stderr.startswith("kvtrio: error: ")
    assert len(result.stderr.strip().splitlines()) == 1


def test_json_logs_are_one_object_per_line_with_named_events(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--log-format", "json")
    with Client(server.endpoint, client_name="log-test") as client:
        client.request(Ping())
    assert server.stop(signal.SIGTERM) == 0
    lines = [json.loads(line) for line in server.log().splitlines()]
    events = {line.get("event"): line for line in lines}
    assert {"serving", "session_start", "session_end", "shutdown", "stopped"} <= events.keys()
    start = events["session_start"]
    assert (start["level"], start["logger"], start["client"]) == (
        "info",
        "kvtrio.server",
        "log-test",
    )
    assert start["message"].startswith(f"session {start['session']}: client log-test")
    assert events["shutdown"]["signal"] == "SIGTERM"
    assert all({"timestamp", "level", "logger", "message"} <= line.keys() for line in lines)


def test_text_logs_say_what_happened_once(server_process: Callable[..., ServerProcess]) -> None:
    server = server_process("--log-level", "info")
    assert server.stop(signal.SIGTERM) == 0
    serving = next(line for line in server.log().splitlines() if "serving on" in line)
    assert " INFO kvtrio: kvtrio " in serving
    assert serving.endswith(")")  # no "[event=serving endpoint=...]" repeating the message
    assert "event=" not in server.log()
