"""What a new user meets first: mistyped endpoints, defaults that say what they take."""

from __future__ import annotations

import time

import pytest

from .test_cli import run

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
