"""Issue 32: ``kvtrio bench --server`` runs again and again against one server (each run's
tenant gets the arena of the run before it, renewed), as the quickstart suggests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from kvtrio.launch import ServerProcess

from .._support.command import KVTRIO

SMALL = ("--world-size", "2", "--layers", "2", "--heads", "2", "--head-dim", "16")
SHORT = ("--conversations", "2", "--turns", "2", "--system-tokens", "300", "--no-progress")


def test_bench_runs_three_times_against_one_server(
    server_process: Callable[..., ServerProcess],
) -> None:
    """Was: the second run failed after 62 s with ``quota_exceeded`` (every run is a new
    tenant, and the default server's one arena stayed with the first run's tenant)."""
    server = server_process()  # --l1-tenants 1 (the default)
    for run in range(3):
        done = subprocess.run(
            [KVTRIO, "bench", *SMALL, *SHORT, "--server", server.endpoint],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"run {run + 1}: {done.stdout}{done.stderr}"
        assert "checksum failures" in done.stdout
        assert "quota_exceeded" not in done.stdout + done.stderr
