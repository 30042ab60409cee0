"""What a new user meets first: mistyped endpoints, defaults that say what they take."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtrio.launch import ServerProcess

from .._support.command import run

BAD_ENDPOINTS = ["127.0.0.1:5577", "localhost:5577", "http://127.0.0.1:5577", "tcp://nonsense"]


@pytest.mark.parametrize("endpoint", BAD_ENDPOINTS)
@pytest.mark.parametrize(
    "command", [["ping"], ["status"], ["bench", "--no-progress", "--server"]], ids=" ".join
)
def test_a_mistyped_endpoint_is_one_line_and_a_failure(command: list[str], endpoint: str) -> None:
    started = time.monotonic()
    result = run(*command, endpoint, timeout=60)  # the old code hung here
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert endpoint in lines[0]
    assert "Traceback" not in result.stderr
    # The command gives up without waiting for any timeout (start-up of Python included).
    assert elapsed < 10, elapsed


def test_a_near_miss_gets_the_tcp_spelling_as_a_hint() -> None:
    result = run("ping", "localhost:5577")
    assert result.stderr.strip().endswith("did you mean tcp://localhost:5577?")


def test_serve_refuses_a_port_out_of_range() -> None:
    result = run("serve", "--endpoint", "tcp://127.0.0.1:99999")  # libzmq would bind 34463
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "kvtrio: error: invalid setting: endpoint = 'tcp://127.0.0.1:99999' (from --endpoint): "
        "'tcp://127.0.0.1:99999': the port must be a number from 0 to 65535"
    ]


def test_help_shows_sizes_in_units_and_no_blank_defaults() -> None:
    help_text = " ".join(run("serve", "--help").stdout.split())
    assert "--l1-size SIZE" in help_text
    assert "--l1-size SIZE Capacity of the host-memory tier" in help_text
    assert "4GiB, half the shm dir's free space and a quarter of the memory available" in help_text
    assert "arena. [default: auto]" in help_text
    assert "[default: 2MiB]" in help_text
    assert "--chunk-size TOKENS" in help_text
    assert "--lookup-timeout SECONDS" in help_text
    assert "--eviction POLICY" in help_text
    assert "--curve-secret-key FILE" in help_text
    assert "--ipc-group GROUP" in help_text
    assert "--lease-share SHARE" in help_text
    assert "[default: 0.9]" in help_text  # a share, not seconds
    assert "SHARE Share of L1 that pins and reservations together may take" in help_text
    assert "[default: ]" not in help_text
    assert "4294967296" not in help_text
    assert "[default: 34359738368]" not in run("backends").stdout
    assert "capacity       Bytes kept before evicting (unlocked). [default: 32GiB]" in (
        run("backends").stdout
    )


def test_start_line_and_status_say_where_the_data_goes(
    server_process: Callable[..., ServerProcess], short_dir: Path
) -> None:
    l2 = short_dir / "l2"
    server = server_process("--l2", f"disk:path={l2},capacity=2GiB")
    status = run("status", server.endpoint)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert len(lines) < 30  # a summary, not the 130-line document (that is --json)
    assert {"# Server", "# Clients", "# L1", "# L2"} <= set(lines)
    assert f"disk {l2} (up to 2GiB): healthy" in lines
    assert any(line.startswith("size: 64MiB (configured) in ") for line in lines)
    assert "used: 0B of 64MiB (0 chunks, 0 evicted)" in lines
    document = json.loads(run("status", "--json", server.endpoint).stdout)
    assert document["l2"][0]["path"] == str(l2)
    assert document["l2"][0]["capacity_bytes"] == 2 << 30
    server.stop()
    data = next(line for line in server.log().splitlines() if " data: " in line)
    assert "L1 64MiB (configured) of shared memory in " in data
    assert data.endswith(f"; L2 disk {l2} (up to 2GiB)")
